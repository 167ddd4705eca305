"""Ulysses all-to-all between sequence-split and head-split attention inputs (Jacobs et al. 2023,
"DeepSpeed Ulysses", section 3).

Legend: s = sequence held by the whole Ulysses group, u = group size, b = batch, n = heads,
d = head dim. Sequence chunks are contiguous and in group-rank order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["heads_to_seq", "seq_to_heads"]


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    u = dist.get_world_size(group)
    s_local, b, n, d = x.shape
    send = x.reshape(s_local, b, u, n // u, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)  # [u, s/u, b, n/u, d]: recv[j] = rank j's sequence chunk
    dist.all_to_all_single(recv, send, group=group)
    return recv.reshape(u * s_local, b, n // u, d)  # [s, b, n/u, d]


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    u = dist.get_world_size(group)
    s, b, n_local, d = x.shape
    send = x.reshape(u, s // u, b, n_local, d).contiguous()  # [u, s/u, b, n/u, d]
    recv = torch.empty_like(send)  # recv[j] = my sequence chunk of rank j's heads
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(s // u, b, u * n_local, d)  # [s/u, b, n, d]


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[s/u, b, n, d]` sequence chunk, all heads -> `[s, b, n/u, d]` full sequence, u-th of heads."""
    return x if dist.get_world_size(group) == 1 else _SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of `seq_to_heads`: `[s, b, n/u, d]` -> `[s/u, b, n, d]`."""
    return x if dist.get_world_size(group) == 1 else _HeadsToSeq.apply(x, group)
