"""Ulysses all-to-all between sequence-split and head-split attention inputs (Jacobs et al. 2023,
"DeepSpeed Ulysses", section 3).

Legend: s = sequence held by the whole Ulysses group, u = group size, b = batch, n = heads,
d = head dim. Sequence chunks are contiguous and in group-rank order.

The even split of the packed FlexSP exchange (runtime/flexsp/ulysses.py): every rank holds s/u
tokens, and the batch dim rides along. One primitive, one autograd pair, for both runtimes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext.runtime.flexsp import ulysses as packed

__all__ = ["heads_to_seq", "seq_to_heads"]


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[s/u, b, n, d]` sequence chunk, all heads -> `[s, b, n/u, d]` full sequence, u-th of
    heads."""
    u = dist.get_world_size(group)
    return x if u == 1 else packed.seq_to_heads(x, group, [x.shape[0]] * u)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of `seq_to_heads`: `[s, b, n/u, d]` -> `[s/u, b, n, d]`."""
    u = dist.get_world_size(group)
    return x if u == 1 else packed.heads_to_seq(x, group, [x.shape[0] // u] * u)
