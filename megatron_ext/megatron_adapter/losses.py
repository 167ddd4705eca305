"""Loss of one micro-batch and of one step for the layerwise runtime (with or without
vocabulary parallelism): megatron `loss_func` values and the step's global per-token loss."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext.megatron_adapter.model import HeteroGPTModel
from megatron_ext.runtime.groups import PlanGroups

__all__ = ["global_loss", "loss_func"]


def loss_func(loss_mask: torch.Tensor, batch_tokens: torch.Tensor, per_token_loss: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(sum of masked loss over this rank's `[b_loc, s_loc]` tokens, loss tokens of the whole
    micro-batch, report [local loss sum, local tokens]).

    The second value is the micro-batch's global count (every rank holds the full loss mask),
    so `finalize_grads` normalises without an all-reduce over data-parallel ranks.
    """
    mask = loss_mask.to(per_token_loss.dtype)
    total = (per_token_loss * mask).sum()
    report = torch.stack([total.detach(), mask.sum().detach()])
    return total, batch_tokens.to(torch.int), {"lm loss": report}


def global_loss(inner: HeteroGPTModel, groups: PlanGroups, reports: list[dict]
                 ) -> dict[str, float]:
    """Per-token loss of the step on every rank: summed over the last stage's distinct token
    blocks (its vocabulary dp_cp group), then broadcast along the pipeline."""
    totals = torch.zeros(2, dtype=torch.float64)  # [loss sum, tokens] over this rank's tokens
    for report in reports:
        totals += report["lm loss"].detach().to(torch.float64)
    plan = groups.plan
    if groups.stage == plan.pp - 1:
        dist.all_reduce(totals, group=inner.decoder.pg_collection.dp_cp)
    if plan.pp > 1:
        last = dist.get_global_rank(groups.pp, plan.pp - 1)
        dist.broadcast(totals, src=last, group=groups.pp)
    return {"loss": float(totals[0] / totals[1]), "num_tokens": float(totals[1])}
