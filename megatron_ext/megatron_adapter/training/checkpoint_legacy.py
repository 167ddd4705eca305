"""Optimizer state in megatron-core's own (chained) layout: checkpoints written before
`checkpoint_optim.PARAM_KEYED` (megatron_ext <= 0.x, and Megatron-LM's own).

Their tensors are keyed by parameter too, but the common part keeps one entry per chained
optimizer (param groups by position, per-stage chains when stages differ), so they reload only
into the same number and kinds of optimizers per pipeline stage (`check_optimizer_layout` says
so in one line, before any model group). New checkpoints use checkpoint_optim.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.ddp import chain_kinds, vocab_zero
from megatron_ext.megatron_adapter.training.checkpoint_optim import PARAM_KEYED
from megatron_ext.plan import ParallelPlan

# The distributed optimizer's state is saved in the layout-independent format, so a checkpoint
# loads under any other plan (Megatron-LM's --dist-ckpt-optim-fully-reshardable). Its default
# `dp_reshardable` only survives a change of the DP degree; `fully_sharded_model_space` fails in
# 0.16.1 ("ShardedTensor.flattened_range is not supported", dist_checkpointing/mapping.py:134).
DISTOPT_SHARDING = "fully_reshardable"


def optimizer_format(optimizer: Any) -> str:
    """'distributed' (ZeRO-1 state: per-parameter fp32 main copy + moments), 'local', or both
    ('distributed+local') when a heterogeneous plan mixes ZeRO levels. ZeRO-2/3 classes of the
    layerwise runtime are 'local' in fp32 (megatron's FP32Optimizer, as for DDP layers: the same
    state layout) and 'sharded' under bf16/fp16, where their fp32 shards are the master weights
    while DDP layers keep a separate fp32 copy (Float16OptimizerWithFloat16Params)."""
    inner = _inner_optimizers(optimizer)
    sharded = getattr(optimizer, "_sharded", None) or [False] * len(inner)
    config = getattr(optimizer, "config", None)
    half = bool(getattr(config, "bf16", False) or getattr(config, "fp16", False))
    kinds = {"distributed" if getattr(opt.config, "use_distributed_optimizer", False) else
             "sharded" if is_sharded and half else "local"
             for opt, is_sharded in zip(inner, sharded)}
    return "+".join(sorted(kinds))


def gradient_class_counts(plan: ParallelPlan) -> tuple[int, ...]:
    """Per pipeline stage, how many optimizers the layerwise runtime chains there.

    Mirrors ddp.grad_classes: one class per distinct (tp, zero) among the stage's embedding
    (first stage), layers, final norm and output layer (last stage), or its vocabulary shards
    (vocabulary parallelism, every stage), plus one per distinct (ep, etp, zero) of the routed
    experts of its MoE layers. Pure: computed from the plan alone, before any group.
    """
    counts = [0] * plan.pp
    vocab_parallel = plan.vocab.mode == "vocab_parallel"
    last = len(plan.stages) - 1
    for chunk, (start, end) in enumerate(plan.stages):  # interleaved: one chain per model chunk
        keys: set[tuple] = {(s.tp, s.zero) for s in plan.layers[start:end]}
        keys |= {("experts", plan.layers[i].ep, plan.layers[i].expert_tp, plan.layers[i].zero)
                 for i in range(start, end) if plan.model.is_moe_layer(i)}
        if chunk == last:  # final norm (and the output layer unless vocab-parallel)
            keys.add((plan.vocab.tp, vocab_zero(plan.layers[end - 1].zero)))
        if (chunk == 0 and not vocab_parallel) or vocab_parallel:  # embedding / vocab shards
            keys.add((plan.vocab.tp, vocab_zero(plan.layers[start].zero)))
        counts[chunk % plan.pp] += len(keys)
    return tuple(counts)


def optimizer_chain(plan: ParallelPlan, model_format: str) -> tuple[int, ...]:
    """Per pipeline stage, how many optimizers are chained on a rank of the backend that runs
    `plan` (`model_format`: the backend's ChainFormat, "layerwise" for the layerwise runtime,
    "megatron" for the stock and FlexSP backends, which build one megatron-core optimizer per
    rank)."""
    if model_format == "layerwise":
        return gradient_class_counts(plan)
    return (1,) * plan.pp


def check_optimizer_layout(info: dict[str, Any], plan: ParallelPlan, root: str | Path, *,
                           use_transformer_engine: bool = True) -> None:
    """One-line PlanError when a checkpoint's optimizer state (`info`: its checkpoint_info
    record) cannot be restored under `plan`; checked before any model group. Checkpoints in
    the `PARAM_KEYED` layout always can.

    The moments are keyed by the parameters' own (global layer) keys, so they reshard like the
    weights, and one optimizer per rank reloads under any plan (stock, FlexSP, or a layerwise
    plan with one gradient class per stage); but megatron-core's ChainedOptimizer keeps one
    entry per chained optimizer, with its param groups in the checkpoint's common (rank-0) part,
    and reloads only into the same number of optimizers per stage (optimizer.py:1218). Weights
    reshard under any plan (--no-load-optim keeps them and restarts the moments).
    """
    from megatron_ext.megatron_adapter.training.select import chain_format

    if info.get("optimizer_layout") == PARAM_KEYED:
        return  # keyed by parameter: loads under any plan (checkpoint_optim.py)
    saved = ParallelPlan.from_dict(json.loads(info["plan"]))
    was = optimizer_chain(saved, info.get("model_format", "megatron"))
    now_format = chain_format(plan, use_transformer_engine=use_transformer_engine)
    now = optimizer_chain(plan, now_format)
    if was != now and not (set(was) == set(now) == {1}):
        raise PlanError(
            f"--load={root} holds optimizer state of a plan with {list(was)} gradient classes "
            f"per pipeline stage, this plan has {list(now)}; megatron-core's chained optimizer "
            "cannot reshard between them: add --no-load-optim (weights still load) or resume "
            "under the saved plan")
    kinds_was = [tuple(k) for k in info.get("optimizer_chain") or []]
    kinds_now = [] if now_format == "megatron" else list(chain_kinds(plan))
    if (len(set(kinds_was)) > 1 or len(set(kinds_now)) > 1) and kinds_was != kinds_now:
        raise PlanError(
            f"--load={root} holds optimizer state of a plan whose optimizers per pipeline stage "
            f"are {[list(k) for k in kinds_was]}, this plan's are "
            f"{[list(k) for k in kinds_now]}; stages chaining different kinds of optimizer "
            "(ZeRO-1 distributed, ZeRO-2/3 sharded, local) are saved per stage and reload only "
            "into the same chains: add --no-load-optim (weights still load) or keep each "
            "stage's ZeRO levels")


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def ensure_distopt_state(optimizer: Any) -> None:
    """Give a never-stepped DistributedOptimizer a state to load into.

    Without TE/apex its `state_dict()` asserts one shared `step` (distrib_optimizer.py:642),
    which an empty torch Adam state does not have. megatron-core's own dummy initialisation
    steps on zero grads; its effect on the weights is overwritten by the model load that
    follows, and `fix_adam_step` then sets the real step count.
    """
    for opt in _inner_optimizers(optimizer):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None and not getattr(opt.optimizer, "state", True):
            init()


@contextlib.contextmanager
def tolerate_missing_step(optimizer: Any) -> Iterator[None]:
    """Load `fully_reshardable` distributed-optimizer state into torch Adam.

    The checkpoint holds param/exp_avg/exp_avg_sq per parameter, but the copy loop copies every
    key of the live state, including torch Adam's per-parameter `step`, and raises
    KeyError('step') (megatron/core/optimizer/distrib_optimizer.py:940). For the duration of
    the load, `step` is set aside around each copy; `fix_adam_step` sets it afterwards.
    """
    patched = []
    for opt in _inner_optimizers(optimizer):
        original = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if original is None:
            continue

        def tolerant(model_param: Any, tensors: Any, _opt: Any = opt,
                     _orig: Any = original) -> None:
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            main_param = _opt.optimizer.param_groups[group_index]["params"][group_order]
            state = _opt.optimizer.state[main_param]
            step = state.pop("step", None)
            try:
                _orig(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        opt._set_main_param_and_optimizer_states = tolerant
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def fix_adam_step(optimizer: Any, num_steps: int) -> None:
    """Set torch Adam's per-parameter `step` lost by the distributed optimizer's load
    (distrib_optimizer.py:940 restores exp_avg/exp_avg_sq, not `step`): every parameter has been
    stepped `num_steps` times."""
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None or not hasattr(inner, "state"):
            continue
        for param_state in inner.state.values():
            if "step" in param_state:
                step = param_state["step"]
                param_state["step"] = (torch.full_like(step, float(num_steps))
                                       if torch.is_tensor(step) else num_steps)


def check_legacy_format(common: dict[str, Any], backend: Any, plan: ParallelPlan,
                        root: str | Path, rank: int) -> str:
    """The saved optimizer format for this rank's stage; one-line PlanError when this plan's
    optimizer is of another kind (the ZeRO level changed)."""
    saved_format = common["megatron_ext"]["optimizer_format"]  # rank 0's (the common part)
    chain = common["megatron_ext"].get("optimizer_chain")
    if chain and backend.chain_format == "layerwise" and len(chain) == plan.pp:
        # this rank's stage as saved: stages may chain different kinds (check_optimizer_layout
        # compared the chains stage by stage)
        saved_format = "+".join(sorted(set(chain[rank // plan.stage_width])))
    if saved_format != optimizer_format(backend.optimizer):
        raise PlanError(
            f"--load={root} holds {saved_format} optimizer state (written before optimizer "
            f"state was keyed by parameter) but this plan uses the "
            f"{optimizer_format(backend.optimizer)} optimizer (the ZeRO level changed); add "
            "--no-load-optim to restart the optimizer moments, or keep the ZeRO level")
    return saved_format


def restore_legacy(backend: Any, loaded: Any, saved_format: str, num_steps: int) -> None:
    """Load megatron-core's chained optimizer state of an older checkpoint."""
    # no_grad: distopt copies into views of leaf params (distrib_optimizer.py:940)
    with torch.no_grad(), tolerate_missing_step(backend.optimizer):
        backend.optimizer.load_state_dict(loaded)
    if "distributed" in saved_format:
        fix_adam_step(backend.optimizer, num_steps)
