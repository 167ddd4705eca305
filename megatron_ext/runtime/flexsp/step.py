"""One FlexSP training step: micro-batches on heterogeneous groups, token-level loss, one
gradient all-reduce over every rank.

Why the gradients come out right whatever the groups: every rank holds the whole (replicated or
ZeRO-sharded) model, and a rank's local gradient is the sum over its own tokens' losses (the
Ulysses all-to-alls route attention gradients back to the tokens' owners). Scaling each rank's
summed token loss by 1 / (tokens in the whole global batch) and summing gradients over all ranks
therefore gives exactly the gradient of the global per-token mean loss, the non-parallel loss
(ByteScale Eqs. 1-2). FlexSP's released code instead rescales per-rank means by sample counts,
which is not the token-level loss (reference §7.3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from megatron_ext.runtime.flexsp.dispatch import RankMicroBatch
from megatron_ext.runtime.flexsp.groups import FlexSPGroups

__all__ = ["allreduce_gradients", "global_token_count", "run_microbatches"]

LossFn = Callable[[RankMicroBatch, torch.Tensor, dist.ProcessGroup | None], torch.Tensor]
"""(view, rows [t, c], group) -> summed per-token loss of this rank's tokens (a scalar)."""


def global_token_count(rows: Iterable[torch.Tensor | None], *, label_column: int,
                       ignore_index: int = -100, group: dist.ProcessGroup | None = None) -> int:
    """Tokens with a label in the whole global batch (all micro-batches, all ranks)."""
    count = sum(int((r[:, label_column] != ignore_index).sum()) for r in rows if r is not None)
    total = torch.tensor([count], dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return int(total.item())


def run_microbatches(
    views: list[RankMicroBatch | None],
    rows: list[torch.Tensor | None],
    loss_fn: LossFn,
    *,
    groups: FlexSPGroups,
    num_loss_tokens: int,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    forward_only: bool = False,
) -> torch.Tensor:
    """Forward + backward of this rank's micro-batches; returns this rank's share of the global
    mean loss (all-reduce it for the step's loss). Gradients accumulate in the parameters.

    `no_sync` (e.g. megatron DDP's): entered for every active micro-batch but this rank's last
    one, so an overlapped gradient reduction starts during the last backward this rank runs
    (ranks finish at different micro-batches: their groups idle at different times)."""
    share = torch.zeros((), dtype=torch.float64)
    active = [m for m, view in enumerate(views) if view is not None]
    for m in active:
        view, part = views[m], rows[m]
        assert view is not None and part is not None
        group = groups.get(view.group_start, view.degree)
        last = m == active[-1]
        with no_sync() if no_sync is not None and not last else contextlib.nullcontext():
            loss = loss_fn(view, part, group) / num_loss_tokens
            if not forward_only:
                loss.backward()
        share += loss.detach().to(torch.float64).cpu()
    return share


def allreduce_gradients(params: Iterable[torch.nn.Parameter], *,
                        group: dist.ProcessGroup | None = None) -> None:
    """Sum gradients over `group` (default: every rank) in one flat all-reduce per dtype."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # an idle rank still takes part in the sum
            by_dtype.setdefault(p.grad.dtype, []).append(p)
    for plist in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in plist])  # [sum of numels]
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in plist:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
