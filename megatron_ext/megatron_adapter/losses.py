"""The one megatron `forward_step_func` and `loss_func` of every backend, and the step's loss.

Legend: b = samples of the micro-batch the rank read, s = seq_length; `_loc` = this rank's block.

Megatron-LM's pretrain_gpt.py shape: `forward_step(data_iterator, model)` returns the model's
per-token losses and `loss_func(output)` returns (masked loss sum, loss tokens, report). What
differs between backends is only which part of the micro-batch a model takes and which tokens
its per-token losses cover; a `BatchView` says that:
- `stock_view(cp_group)`: stock GPTModel: the batch cut to this context-parallel rank
  (`get_batch_on_this_cp_rank`), the local loss-token count (megatron-core's schedule and
  `finalize_model_grads` normalise);
- `layerwise_view`: the layerwise runtime's `HeteroGPTModel` takes the rows this rank read
  (`model.batch_shard`) and slices its part per layer layout; the local loss-token count
  (`ddp.finalize_grads` sums it over the last stage's token blocks);
- `vocab_view`: the same model as a body stage under vocabulary parallelism (input via
  `set_input_tensor`; losses of its vocabulary block).
FlexSP cuts samples into documents and runs its own step (flexsp/model.py); it uses `loss_func`'s
NaN check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_attr_wrapped_model

from megatron_ext.megatron_adapter.compat import cp_batch
from megatron_ext.megatron_adapter.model import HeteroGPTModel
from megatron_ext.runtime.groups import PlanGroups

__all__ = ["BatchView", "check_loss", "forward_step", "global_loss", "layerwise_forward_step",
           "layerwise_view", "loss_func", "stock_view", "vocab_view"]

Batch = dict[str, torch.Tensor]
BatchView = Callable[[Batch, torch.nn.Module],
                     tuple[dict[str, Any], torch.Tensor | None, torch.Tensor | None]]
"""(batch, model) -> (model keyword arguments, loss mask of the model's per-token losses or
None on a stage without loss, loss-token count to report or None for the mask's own count)."""


def check_loss(loss: torch.Tensor) -> None:
    """--check-for-nan-in-loss-and-grad on the loss: Megatron-LM pretrain_gpt.py's check
    (megatron-core's rerun state machine; fatal on NaN or Inf)."""
    machine = get_rerun_state_machine()
    for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
        machine.validate_result(result=loss, rejection_func=reject,
                                message=f"found {what} in local forward loss calculation",
                                tolerance=0.0, fatal=True)


def loss_func(loss_mask: torch.Tensor, num_tokens: torch.Tensor | None, check_nan: bool,
              per_token_loss: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(sum of masked per-token loss over this rank's tokens, loss tokens, report [local loss
    sum, local tokens]). `num_tokens` None: this rank's own count."""
    losses = per_token_loss.reshape(-1)  # [b_loc*s_loc]
    if losses.dtype in (torch.float16, torch.bfloat16):  # sums in fp32 (fp64 stays fp64)
        losses = losses.float()
    mask = loss_mask.to(losses.dtype).reshape(-1)  # [b_loc*s_loc]
    total = torch.sum(losses * mask)
    if check_nan:
        check_loss(total)
    count = mask.sum().detach()
    report = torch.stack([total.detach(), count])  # [2]
    tokens = count if num_tokens is None else num_tokens
    return total, tokens.to(torch.int), {"lm loss": report}


def forward_step(view: BatchView, check_nan: bool, data_iterator: Iterator[Batch] | None,
                 model: torch.nn.Module) -> tuple[torch.Tensor, Callable[..., Any]]:
    """megatron `forward_step_func` (bind `view` and `check_nan` with functools.partial)."""
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:  # a stock middle stage: activations come from the previous stage
        return model(None, None, None), partial(loss_func, None, None, check_nan)
    inputs, mask, num_tokens = view(batch, model)
    output = model(**inputs)
    return output, partial(loss_func, mask, num_tokens, check_nan)


def stock_view(cp_group: dist.ProcessGroup | None, batch: Batch, model: torch.nn.Module
               ) -> tuple[dict[str, Any], torch.Tensor, None]:
    if cp_group is not None and cp_group.size() > 1:
        batch = cp_batch(batch, cp_group)  # [b, s/cp] each
    inputs = {"input_ids": batch["tokens"], "position_ids": batch["position_ids"],
              "attention_mask": batch.get("attention_mask"), "labels": batch["labels"],
              "loss_mask": batch["loss_mask"]}
    return inputs, batch["loss_mask"], None


def _inner(model: torch.nn.Module) -> HeteroGPTModel:
    return get_attr_wrapped_model(model, "local_tokens", return_model_obj=True)


def layerwise_view(batch: Batch, model: torch.nn.Module
                   ) -> tuple[dict[str, Any], torch.Tensor | None, torch.Tensor | None]:
    inner = _inner(model)
    inputs = {"input_ids": batch["tokens"] if inner.pre_process else None,
              "position_ids": batch.get("position_ids"),
              "labels": batch["labels"] if inner.post_process else None}
    if not inner.post_process:
        return inputs, None, None
    mask = inner.local_tokens(batch["loss_mask"])  # [b_loc, s_loc]
    return inputs, mask, None  # finalize_grads sums the counts over the token blocks


def vocab_view(batch: Batch, model: torch.nn.Module
               ) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    inner = _inner(model)
    mask = inner.vocab_tokens(batch["loss_mask"])  # [b_loc, s_loc]
    return {"position_ids": batch.get("position_ids")}, mask, None


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


layerwise_forward_step = partial(forward_step, layerwise_view, False)
"""megatron `forward_step_func` of the layerwise runtime without the NaN check: full
micro-batch in, per-token loss of this rank out (benchmarks wrap it in probes)."""
