"""Vocabulary-parallel 1F1B with megatron-core's schedule signature (Yeung et al. 2025, sec. 6).

Legend: s = sequence, b = micro-batch, h = hidden, p = pipeline stages, M = micro-batches.

`make_vocab_parallel_schedule(options)` returns a drop-in for
`get_forward_backward_func()`: the same keyword arguments, the same return value
(forward_data_store on the last stage). It runs Megatron's 1F1B call for call (its
`forward_step`, `backward_step`, `P2PCommunicator` calls, `deallocate_output_tensor`,
`finalize_model_grads_func`), with `num_barriers` more warm-up forwards, and inserts the
vocabulary passes of every micro-batch where planner/vocab/schedule_plan.py put them. Their
collectives are asynchronous, one group per kind, waited on where their results are needed
(runtime/vocab/passes.py), so barriers overlap transformer passes on any device.

Contract (beyond Megatron's):
  * `model` is a VocabParallelStage (vocab/layers.py), possibly wrapped (DDP, Float16Module).
    Its body is pre_process=False on every stage: the first stage gets the summed input
    embedding through `set_input_tensor`; the last stage's body returns the final-norm output.
  * `data_iterator` yields, on EVERY rank, each micro-batch as a dict with "tokens" and
    "labels" ([b, s] token ids): the vocabulary passes of every rank need them. The schedule
    reads all M up front and hands `forward_step_func` a one-item iterator per micro-batch.
  * `forward_step_func(iterator, model)` returns (hidden [s, b, h], loss_func) as usual; on the
    last stage loss_func is called with the per-token losses [b, s] (what GPTModel returns with
    labels), and its gradient w.r.t. them is what the T passes and the last B use, so masks,
    per-token averaging (`calculate_per_token_loss`) and `grad_scale_func` work as in Megatron.
  * Gradient sync stays disabled (no_sync) for the whole schedule and is started at the end
    (`grad_sync_func` if set), because vocabulary weights get several backward calls per
    micro-batch. Tied embeddings need no embedding group: pass pg_collection.embd = None.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import (
    get_forward_backward_func,
    get_tensor_shapes,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config

from megatron_ext.megatron_adapter.vocab.iteration import VocabIteration
from megatron_ext.megatron_adapter.vocab.layers import (
    VocabScheduleOptions,
    num_barriers_for,
)
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.vocab.schedule_ops import Op
from megatron_ext.planner.vocab.schedule_plan import plan_vocab_schedule
from megatron_ext.runtime.vocab.comm import VocabCommGroups


def make_vocab_parallel_schedule(options: VocabScheduleOptions) -> Callable[..., list]:
    """A forward-backward function with Megatron's keyword signature (see module doc)."""
    return functools.partial(forward_backward_vocab_parallel, options=options)


def schedule_for_plan(plan: ParallelPlan, groups: VocabCommGroups | None = None,
                      **options: Any) -> Callable[..., list]:
    """The plan's schedule: Megatron's 1F1B for vocab mode "tp", vocabulary-parallel 1F1B
    (with the plan's algorithm and stage layer counts for placement) for "vocab_parallel"."""
    if plan.vocab.mode != "vocab_parallel":
        return get_forward_backward_func(pp_size=plan.pp)
    if groups is None:
        raise ValueError("vocab.mode=vocab_parallel needs the vocabulary groups: build them with "
                         "new_vocab_comm_groups(vocab_rank_lists(stage ranks, vocab.tp), ...)")
    return make_vocab_parallel_schedule(VocabScheduleOptions(
        groups=groups, num_barriers=num_barriers_for(plan.vocab),
        layers_per_stage=tuple(end - start for start, end in plan.stages),
        ffn_hidden_size=plan.model.ffn_hidden_size, **options))


def forward_backward_vocab_parallel(
    *,
    forward_step_func: Callable,
    data_iterator: Iterator | list[Iterator],
    model: torch.nn.Module | list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: P2PCommunicator | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    force_all_reduce: bool | None = False,
    options: VocabScheduleOptions,
) -> list:
    """One iteration of vocabulary-parallel 1F1B; returns the last stage's forward_data_store."""
    model = _single(model, "model")
    batches_in: Iterator = _single(data_iterator, "data_iterator")
    config = get_model_config(model)
    if config.overlap_p2p_comm or adjust_tensor_shapes_fn is not None:
        raise ValueError("vocabulary-parallel 1F1B supports neither overlap_p2p_comm nor "
                         "adjust_tensor_shapes_fn; unset them")
    p2p, pgc = _communicators(p2p_communicator, pg_collection, config)
    shapes = get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size,
                               decoder_seq_length=decoder_seq_length, config=config,
                               tp_group=pgc.tp, cp_group=pgc.cp)
    run = VocabIteration(
        model=model, config=config, p2p=p2p, pgc=pgc, options=options, shape=tuple(shapes[0]),
        batches=[next(batches_in) for _ in range(num_microbatches)],
        forward_step_func=forward_step_func, forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
        order_fn=_pass_order)
    with _grad_sync_disabled(config) as enable_sync:
        run.execute()
        run.runner.close()
        if not forward_only:
            enable_sync()
            if config.grad_sync_func is not None:
                config.grad_sync_func(model.parameters())
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(
            [model], run.total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pgc, force_all_reduce=force_all_reduce)
    return run.forward_data_store


def _single(value: Any, name: str) -> Any:
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"{name}: vocabulary-parallel 1F1B takes one model chunk, "
                             f"got {len(value)}")
        return value[0]
    return value


def _communicators(
    p2p: P2PCommunicator | None, pgc: ProcessGroupCollection | None, config: Any
) -> tuple[P2PCommunicator, ProcessGroupCollection]:
    """Megatron's rule: pass both or neither (then parallel_state's groups are used)."""
    if (p2p is None) != (pgc is None):
        raise ValueError("pass both p2p_communicator and pg_collection, or neither")
    if p2p is not None:
        return p2p, pgc  # type: ignore[return-value]
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pgc = ProcessGroupCollection(
        tp=parallel_state.get_tensor_model_parallel_group(), pp=pp_group,
        cp=parallel_state.get_context_parallel_group(), embd=None, pos_embd=None,
        dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return P2PCommunicator(pp_group=pp_group, config=config), pgc


@contextlib.contextmanager
def _grad_sync_disabled(config: Any):  # type: ignore[no-untyped-def]
    """Megatron's no_sync for the whole schedule; yields a function that re-enables it."""
    context = (config.no_sync_func or contextlib.nullcontext)()
    context.__enter__()
    state = {"open": True}

    def enable() -> None:
        if state["open"]:
            state["open"] = False
            context.__exit__(None, None, None)

    try:
        yield enable
    finally:
        enable()


@functools.lru_cache(maxsize=32)
def _pass_order(num_stages: int, num_microbatches: int, num_barriers: int, costs: Any,
                forward_only: bool) -> tuple[tuple[Op, ...], ...]:
    timeline = plan_vocab_schedule(num_stages, num_microbatches, num_barriers=num_barriers,
                                   costs=costs, forward_only=forward_only)
    return tuple(tuple(timeline.order(r)) for r in range(num_stages))
