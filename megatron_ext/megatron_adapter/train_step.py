"""One optimizer step of a heterogeneous plan on megatron-core's own schedules.

Legend: s = sequence, b = micro-batch (all replicas), h = hidden.

pp = 1 runs `forward_backward_no_pipelining`; pp > 1 runs megatron-core's 1F1B
(`forward_backward_pipelining_without_interleaving`) with this plan's `P2PCommunicator` and an
`adjust_tensor_shapes_fn`: stage p receives `[s_loc, b_loc, h]` of the layout stage p-1 sends
(its last layer's) and sends its own last layer's layout, so uneven stages and different
strategies on both sides of a boundary pass fixed, known shapes (no shape exchange).
Batches are dicts of full micro-batch tensors `[b, s]` (tokens, labels, loss_mask, optional
position_ids), identical on every rank of a stage; the model slices its part.

Interleaved plans (virtual_stages > 1) run megatron-core's
`forward_backward_pipelining_with_interleaving` over the rank's model chunks. That schedule
passes one tensor shape for every message (no adjust_tensor_shapes_fn), so every chunk boundary
carries one layout (plan_layouts.chunk_boundary_layout) and `ChunkP2P` sends and receives its
`[s_loc, b_loc, h]`. The chunk reading tokens (chunk 0 on the first stage) or labels (the last
chunk on the last stage) gets the data iterator; the others get None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

from megatron_ext.geometry.stages import chunk_shape, stage_shapes
from megatron_ext.megatron_adapter.ddp import HeteroDDP
from megatron_ext.megatron_adapter.losses import forward_step as _forward_step
from megatron_ext.megatron_adapter.losses import global_loss, layerwise_view
from megatron_ext.megatron_adapter.model import HeteroGPTModel
from megatron_ext.megatron_adapter.optimizer import HeteroChainedOptimizer
from megatron_ext.runtime.groups import PlanGroups

__all__ = ["forward_backward", "forward_step", "train_step"]

Batch = dict[str, torch.Tensor]


class ChunkP2P(P2PCommunicator):
    """megatron-core's P2PCommunicator with every message of `shape` (the interleaved
    schedule's own shape assumes one uniform layout and the global micro-batch)."""

    def __init__(self, *, pp_group: Any, config: Any, shape: tuple[int, int, int]) -> None:
        super().__init__(pp_group=pp_group, config=config)
        self.shape = shape

    def _communicate(self, *, tensor_shape: Any, **kwargs: Any) -> Any:  # noqa: ARG002
        return super()._communicate(tensor_shape=self.shape, **kwargs)


forward_step = partial(_forward_step, layerwise_view, False)
"""megatron `forward_step_func` of the runtime: full micro-batch in, per-token loss of this rank
out (without the NaN check; `forward_backward(check_nan=True)` adds it)."""


def forward_backward(
    chunks: list[HeteroDDP],
    data_iterator: Iterator[Batch],
    groups: PlanGroups,
    *,
    forward_step_func: Callable[..., Any] | None = None,
    forward_only: bool = False,
    check_nan: bool = False,
    num_microbatches: int | None = None,
) -> dict[str, float]:
    """Forward (and backward) over `num_microbatches` (default the plan's) micro-batches; grads
    are finalized. `check_nan`: --check-for-nan-in-loss-and-grad on each micro-batch's loss.

    Returns the global per-token loss and token count, identical on every rank.
    """
    plan = groups.plan
    num_microbatches = num_microbatches or plan.num_microbatches
    if plan.vocab.mode == "vocab_parallel":  # vocabulary passes on every stage
        from megatron_ext.megatron_adapter.vocab.runtime import vocab_forward_backward

        return vocab_forward_backward(
            chunks, data_iterator, groups, forward_only=forward_only,
            forward_step_func=forward_step_func, check_nan=check_nan,
            num_microbatches=num_microbatches)
    forward_step_func = forward_step_func or partial(_forward_step, layerwise_view, check_nan)
    inner: HeteroGPTModel = chunks[0].module
    config = inner.config
    kwargs: dict[str, Any] = {}
    if plan.virtual_stages > 1:
        comm = ChunkP2P(pp_group=groups.pp, config=config,
                        shape=chunk_shape(plan, config.hidden_size))
        kwargs = {"p2p_communicator": comm}
        reads = [c.module.pre_process or c.module.post_process for c in chunks]
        data_iterator = [data_iterator if r else None for r in reads]  # type: ignore[assignment]
    elif plan.pp > 1:
        recv, send = stage_shapes(plan, groups.stage, config.hidden_size)
        kwargs = {"adjust_tensor_shapes_fn": lambda _r, _s: (recv, send),
                      "p2p_communicator": P2PCommunicator(pp_group=groups.pp, config=config)}
    vp_size = plan.virtual_stages if plan.virtual_stages > 1 else None
    reports = get_forward_backward_func(pp_size=plan.pp, vp_size=vp_size)(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=chunks,
        num_microbatches=num_microbatches, seq_length=plan.seq_length,
        micro_batch_size=plan.micro_batch_size, forward_only=forward_only,
        pg_collection=inner.pg_collection, **kwargs,
    )
    if forward_only:
        for chunk in chunks:
            getattr(chunk, "reshard", lambda: None)()  # ZeRO-2 weights gathered for forward
    return global_loss(chunks[-1].module, groups, reports)


def train_step(
    chunks: list[HeteroDDP],
    optimizer: HeteroChainedOptimizer,
    data_iterator: Iterator[Batch],
    groups: PlanGroups,
    *,
    forward_step_func: Callable[..., Any] | None = None,
) -> dict[str, float]:
    """Zero grads, `forward_backward`, optimizer step: loss, grad_norm, num_tokens, update ok."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    result = forward_backward(chunks, data_iterator, groups, forward_step_func=forward_step_func)
    ok, grad_norm, _ = optimizer.step()
    result.update(grad_norm=float(grad_norm or 0.0), update_successful=float(ok))
    return result
