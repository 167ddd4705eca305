"""Vocabulary parallelism on the layerwise heterogeneous runtime: one forward-backward of a
`vocab.mode = vocab_parallel` plan.

Legend: s = sequence, b = micro-batch (all replicas), h = hidden; `_loc` = this rank's block.

`build_model` builds every stage as a body (`HeteroGPTModel`, no embedding / output layer) that
holds its vocabulary shards (`model.vocab`) and takes / returns the vocabulary passes' layout
(runtime/vocab/layout.py) on the first / last stage. Here the stage boundaries keep the runtime's
shapes (`plan_layouts.stage_shapes`: the sending stage's last-layer layout), the vocabulary passes
work on `[s_loc, b_loc, h]` of that layout, and vocab/schedule.py's 1F1B runs them. Every rank
reads every micro-batch (full `[b, s]` tokens, labels, loss_mask); each slices its part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_ext.geometry.stages import stage_shapes
from megatron_ext.geometry.vocab import vocab_parallel_layout
from megatron_ext.megatron_adapter.ddp import HeteroDDP
from megatron_ext.megatron_adapter.losses import forward_step, global_loss, vocab_view
from megatron_ext.megatron_adapter.model import HeteroGPTModel
from megatron_ext.megatron_adapter.vocab.schedule import schedule_for_plan
from megatron_ext.runtime.groups import PlanGroups

__all__ = ["vocab_forward_backward", "vocab_forward_step"]

Batch = dict[str, torch.Tensor]


vocab_forward_step = partial(forward_step, vocab_view, False)
"""megatron `forward_step_func` of a body stage: hidden states out `[s_loc, b_loc, h]`; the loss
function (called on the last stage by the schedule's L pass) takes the per-token losses
`[b_loc, s_loc]` of this rank's vocabulary block and masks them with its part of loss_mask."""


def vocab_forward_backward(
    chunks: list[HeteroDDP],
    data_iterator: Iterator[Batch],
    groups: PlanGroups,
    *,
    forward_step_func: Callable[..., Any] | None = None,
    forward_only: bool = False,
    schedule_options: dict[str, Any] | None = None,
    check_nan: bool = False,
    num_microbatches: int | None = None,
) -> dict[str, float]:
    """`train_step.forward_backward` for vocab_parallel plans: grads finalized, the global
    per-token loss and token count returned on every rank. `schedule_options`: extra
    `VocabScheduleOptions` fields (pass_timer: benchmarks)."""
    plan = groups.plan
    inner: HeteroGPTModel = chunks[0].module
    assert inner.vocab is not None and inner.vocab_groups is not None, "built without vocab"
    config = inner.config
    hidden = config.hidden_size
    s_loc, b_loc = vocab_parallel_layout(plan).local_shape(plan.seq_length,
                                                           plan.micro_batch_size)
    block = (s_loc, b_loc, hidden)  # [s_loc, b_loc, h]
    (recv,), (send,) = stage_shapes(plan, groups.stage, hidden)  # () at the pipeline ends
    schedule = schedule_for_plan(
        plan, inner.vocab_groups, p2p_shapes=(recv or block, send or block), hidden_shape=block,
        select_tokens=inner.vocab_tokens, **(schedule_options or {}))
    reports = schedule(
        forward_step_func=forward_step_func or partial(forward_step, vocab_view, check_nan),
        data_iterator=data_iterator, model=chunks,
        num_microbatches=num_microbatches or plan.num_microbatches, seq_length=plan.seq_length,
        micro_batch_size=plan.micro_batch_size, forward_only=forward_only,
        p2p_communicator=P2PCommunicator(pp_group=groups.pp, config=config),
        pg_collection=inner.pg_collection)
    return global_loss(inner, groups, reports)
