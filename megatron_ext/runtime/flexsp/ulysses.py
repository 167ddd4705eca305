"""Ulysses all-to-all for packed variable-length tokens (DeepSpeed-Ulysses §3, FlexSP §7.2).

Legend: t = this rank's tokens of the group's packed stream, T = all of the group's tokens
(sum of `token_counts`, which may differ by rank: no padding), u = group size, n = heads,
d = head dim. Rank i of the group holds tokens [sum(token_counts[:i]), ...+token_counts[i]).

seq_to_heads: [t, n, d] (my tokens, all heads) -> [T, n/u, d] (all tokens, my heads);
heads_to_seq is its inverse; each is the other's backward. One `all_to_all_single` with uneven
split sizes each way, so gloo, NCCL and any backend with alltoallv work. Dims between the token
and head dims ride along ([t, b, n, d] -> [T, b, n/u, d]), so with equal counts this is also
the layerwise runtime's even-split Ulysses exchange (runtime/ulysses.py).

Grouped-query attention: with g kv heads and a group of u ranks, k/v are scattered by head
unduplicated when u divides g. When g < u (and g divides u), each kv head is repeated u/g
times before the all-to-all, so every rank receives exactly the one kv head its query heads
use: the least duplication that keeps the exchange uniform (FlexSP repeats to all n heads).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.errors import PlanError

__all__ = ["check_ulysses_degree", "heads_to_seq", "kv_repeat_factor", "seq_to_heads"]


def check_ulysses_degree(num_heads: int, num_kv_heads: int, degree: int) -> None:
    """Raise PlanError unless a Ulysses group of `degree` ranks can split these heads."""
    if num_heads % degree:
        largest = 1
        while num_heads % (largest * 2) == 0:
            largest *= 2
        raise PlanError(
            f"a Ulysses group of {degree} ranks needs num_attention_heads={num_heads} divisible "
            f"by {degree}; cap the FlexSP max degree at {largest} (or use a model with more heads)"
        )
    if num_kv_heads % degree and degree % num_kv_heads:
        raise PlanError(
            f"a Ulysses group of {degree} ranks cannot split num_query_groups={num_kv_heads}: "
            f"one must divide the other; cap the FlexSP max degree at a divisor of {num_kv_heads}"
        )


def kv_repeat_factor(num_kv_heads: int, degree: int) -> int:
    """How often each kv head is repeated before the all-to-all (1 = not at all)."""
    return 1 if num_kv_heads % degree == 0 else degree // num_kv_heads


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, counts: list[int]) -> torch.Tensor:
    u = len(counts)
    t, mid, (n, d) = x.shape[0], x.shape[1:-2], x.shape[-2:]
    m = math.prod(mid)
    send = x.reshape(t, m, u, n // u, d).permute(2, 0, 1, 3, 4)  # [u, t, m, n/u, d]
    send = send.reshape(u * t, *mid, n // u, d)  # [u*t, ..., n/u, d]: one block per rank
    recv = x.new_empty(sum(counts), *mid, n // u, d)  # [T, ..., n/u, d], rank order = token order
    dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=counts,
                           input_split_sizes=[t] * u, group=group)
    return recv


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, counts: list[int],
                  rank: int) -> torch.Tensor:
    u = len(counts)
    mid, (n_local, d) = x.shape[1:-2], x.shape[-2:]
    m = math.prod(mid)
    t = counts[rank]
    recv = x.new_empty(u * t, *mid, n_local, d)  # [u*t, ..., n/u, d]: my tokens, every rank's heads
    dist.all_to_all_single(recv, x.contiguous(), output_split_sizes=[t] * u,
                           input_split_sizes=counts, group=group)
    out = recv.reshape(u, t, m, n_local, d).permute(1, 2, 0, 3, 4)  # [t, m, u, n/u, d]
    return out.reshape(t, *mid, u * n_local, d)  # [t, ..., n, d]


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup,  # type: ignore[override]
                counts: list[int]) -> torch.Tensor:
        ctx.group, ctx.counts = group, counts
        return _seq_to_heads(x, group, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        rank = dist.get_rank(ctx.group)
        return _heads_to_seq(grad, ctx.group, ctx.counts, rank), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup,  # type: ignore[override]
                counts: list[int]) -> torch.Tensor:
        ctx.group, ctx.counts = group, counts
        return _heads_to_seq(x, group, counts, dist.get_rank(group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return _seq_to_heads(grad, ctx.group, ctx.counts), None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None,
                 token_counts: list[int]) -> torch.Tensor:
    """[t, (...,) n, d] my tokens, all heads -> [T, (...,) n/u, d] all tokens, my heads
    (identity if u = 1)."""
    if group is None or len(token_counts) == 1:
        return x
    assert x.shape[-2] % len(token_counts) == 0, "check_ulysses_degree first"
    return _SeqToHeads.apply(x, group, list(token_counts))


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None,
                 token_counts: list[int]) -> torch.Tensor:
    """Inverse of seq_to_heads: [T, (...,) n/u, d] -> [t, (...,) n, d]."""
    if group is None or len(token_counts) == 1:
        return x
    return _HeadsToSeq.apply(x, group, list(token_counts))
