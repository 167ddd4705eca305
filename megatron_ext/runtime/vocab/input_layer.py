"""Input embedding on one vocabulary shard (Yeung et al. 2025, section 5: IF / IB passes).

Legend: s = sequence, b = micro-batch, h = hidden, v = shard rows.

IF: every rank looks up the tokens of its vocabulary slice (zero rows elsewhere, as Megatron's
VocabParallelEmbedding does); the partial embeddings are summed over the vocabulary group and
the first pipeline stage consumes the sum. IB: the first stage's gradient w.r.t. that sum is
broadcast to the group and every rank backpropagates it into its slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def embedding_forward_pass(
    tokens: torch.Tensor,  # [s, b] global token ids
    weight: torch.Tensor,  # [v, h] this shard of the input embedding
    *,
    vocab_start: int,
    num_valid: int,
) -> torch.Tensor:  # [s, b, h] partial embedding, zero where the token is in another shard
    """IF pass compute: masked lookup with an autograd edge into `weight`."""
    in_shard = (tokens >= vocab_start) & (tokens < vocab_start + num_valid)  # [s, b]
    local = torch.where(in_shard, tokens - vocab_start, torch.zeros_like(tokens))  # [s, b]
    partial = F.embedding(local, weight)  # [s, b, h]
    return partial * in_shard.unsqueeze(-1).to(partial.dtype)  # [s, b, h]


def embedding_backward_pass(partial: torch.Tensor, grad: torch.Tensor) -> None:
    """IB pass compute: accumulate the shard's weight gradient from dL/d(embedding) [s, b, h].

    `partial` may have been pseudo-freed (its data dropped after the forward reduction)."""
    torch.autograd.Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
        tensors=(partial,), grad_tensors=(grad.to(partial.dtype),), keep_graph=False,
        create_graph=False, inputs=(), allow_unreachable=True, accumulate_grad=True,
    )
