"""The router losses Megatron-LM logs for MoE models, for the layerwise runtime.

Megatron-LM (training.py `training_log` -> megatron-core `track_moe_metrics`, moe_utils.py:955)
logs `load_balancing_loss` (aux_loss), `seq_load_balancing_loss`, `global_load_balancing_loss`
and `z_loss`: each MoE layer's router saves its loss divided by the coefficient for every
micro-batch (`save_to_aux_losses_tracker`, moe_utils.py:866); at logging time the values are
summed over pipeline stages and over the group the router summed its counts over (tp x cp),
averaged over data-parallel ranks, then averaged over MoE layers and micro-batches.

Here layers have different layouts, so the reduction is one world all-reduce of every rank's
per-layer values, divided per layer by the number of token blocks that layer has (its dp: each
block's tp x Ulysses x cp ranks hold parts that add up to the block's loss); the global loss is
already whole after the sum over the stage, and the z-loss (a per-rank mean) is averaged over the
stage's ranks. The result is the same on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext.megatron_adapter.compat import clear_moe_metrics, moe_metric_values
from megatron_ext.plan import ParallelPlan

__all__ = ["clear_router_losses", "router_loss_names", "router_losses"]

_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
          "global_aux_loss": "global_load_balancing_loss"}


def router_loss_names(plan: ParallelPlan) -> list[str]:
    """Names Megatron-LM logs for this model, in its order (empty for a dense model)."""
    moe = plan.model.moe
    if moe is None:
        return []
    names = []
    if moe.router_load_balancing_type in _NAMES and moe.aux_loss_coeff > 0:
        names.append(_NAMES[moe.router_load_balancing_type])
    if moe.z_loss_coeff > 0:
        names.append("z_loss")
    return names


def clear_router_losses() -> None:
    """Forget what the routers saved so far (e.g. during evaluation)."""
    clear_moe_metrics()


def router_losses(plan: ParallelPlan, num_microbatches: int) -> dict[str, float]:
    """The step's router losses by Megatron-LM's names; collective over the world (every rank
    calls it after the step's forward-backward). Clears the routers' records."""
    names = router_loss_names(plan)
    if not names:
        return {}
    layers = plan.model.num_layers
    tracker = moe_metric_values()
    values = torch.zeros(len(names), layers, dtype=torch.float64)  # [name, layer]
    for row, name in enumerate(names):
        if name in tracker:
            values[row] = tracker[name].detach().to("cpu", torch.float64)
    dist.all_reduce(values)
    moe_layers = [i for i in range(layers) if plan.model.is_moe_layer(i)]
    out = {}
    for row, name in enumerate(names):
        total = 0.0
        for i in moe_layers:
            strategy = plan.layers[i]
            parts = {"global_load_balancing_loss": 1, "z_loss": strategy.width}.get(
                name, strategy.dp)
            total += float(values[row, i]) / parts
        out[name] = total / len(moe_layers) / num_microbatches
    clear_moe_metrics()
    return out
