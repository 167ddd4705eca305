"""Input embedding on one vocabulary shard (Yeung et al. 2025, section 5: IF / IB passes).

Legend: s = sequence, b = micro-batch, h = hidden, v = shard rows.

IF: every rank looks up the tokens of its vocabulary slice (zero rows elsewhere, as Megatron's
VocabParallelEmbedding does); the partial embeddings are summed over the vocabulary group and
the first pipeline stage consumes the sum. IB: the first stage's gradient w.r.t. that sum is
broadcast to the group and every rank adds the rows of its slice into a gradient buffer
(`index_add`, O(s b h)); `flush_embedding_grad` hands the buffer to autograd once per
iteration, so the weight's grad hooks (DDP) fire once. Autograd's own embedding backward would
materialise a dense [v, h] gradient per micro-batch instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True, slots=True)
class EmbeddingLookup:
    """What IB needs from IF: which positions hit this shard, and where."""

    local_index: torch.Tensor
    """[s, b] int64 row in the shard (0 where the token is elsewhere)."""
    in_shard: torch.Tensor
    """[s, b] bool: the token's row is in this shard."""


def embedding_forward_pass(
    tokens: torch.Tensor,  # [s, b] global token ids
    weight: torch.Tensor,  # [v, h] this shard of the input embedding
    *,
    vocab_start: int,
    num_valid: int,
) -> tuple[torch.Tensor, EmbeddingLookup]:
    """IF compute: the partial embedding [s, b, h] (zero where the token is in another shard;
    no autograd graph) and the lookup IB needs."""
    in_shard = (tokens >= vocab_start) & (tokens < vocab_start + num_valid)  # [s, b]
    local = torch.where(in_shard, tokens - vocab_start, torch.zeros_like(tokens))  # [s, b]
    partial = F.embedding(local, weight.detach())  # [s, b, h]
    partial *= in_shard.unsqueeze(-1).to(partial.dtype)
    return partial, EmbeddingLookup(local_index=local, in_shard=in_shard)


def accumulate_embedding_grad(
    buffer: torch.Tensor,  # [v, h] gradient buffer of the shard
    lookup: EmbeddingLookup,
    grad: torch.Tensor,  # [s, b, h] dL/d(summed embedding)
) -> None:
    """IB compute: buffer[row] += grad at every position whose token is in this shard."""
    rows = lookup.local_index[lookup.in_shard]  # [k]
    buffer.index_add_(0, rows, grad[lookup.in_shard].to(buffer.dtype))  # [k, h] into [v, h]


class _AddGrad(torch.autograd.Function):
    """Identity-free autograd edge: backward hands a precomputed gradient to `weight`."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.grad = grad
        return weight.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.grad, None


def flush_embedding_grad(weight: torch.Tensor, buffer: torch.Tensor) -> None:
    """Accumulate `buffer` into weight's gradient through autograd (grad hooks fire once)."""
    edge = _AddGrad.apply(weight, buffer.to(weight.dtype))
    torch.autograd.backward(edge, torch.empty(0, dtype=edge.dtype, device=edge.device))
