"""Checkpoints with megatron-core `dist_checkpointing`, loadable under any other plan.

Layout (Megatron-LM's): `SAVE/iter_0000010/` (torch_dist shards + common.pt) and
`SAVE/latest_checkpointed_iteration.txt`. A save writes into `iter_0000010.tmp/`, and only after
every rank has finished does rank 0 write the manifest (checkpoint_files.py), rename the
directory and then replace the tracker file atomically (never with an older iteration); a run
killed mid-save therefore leaves the previous checkpoint as the latest complete one. Loading
verifies the directory against its manifest first (`resolve_load`, before any process group).

Tensors are keyed by global layer index (`decoder.layers.7...`), so a different TP/PP/DP layout
reshards on load. RNG states are per rank and restored only when the plan is unchanged; the data
position is a sample count and is restored under any plan.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.ddp import chain_kinds, vocab_zero
from megatron_ext.megatron_adapter.training.checkpoint_files import (
    TRACKER_FILE,
    LoadTarget,
    iteration_dir,
    publish_tracker,
    resolve_load,
    write_manifest,
)
from megatron_ext.plan import ParallelPlan

if TYPE_CHECKING:
    from megatron_ext.megatron_adapter.training.backend import Backend

logger = logging.getLogger(__name__)
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version


@dataclass(kw_only=True, slots=True)
class TrainState:
    """Loop counters saved with every checkpoint."""

    iteration: int = 0
    """Optimizer steps taken (successful or skipped)."""
    consumed_train_samples: int = 0
    """Training samples read, all data-parallel replicas together."""
    consumed_valid_samples: int = 0
    """Validation samples read, all replicas together."""
    skipped_iterations: int = 0
    """Steps the fp16 loss scaler skipped; iteration - skipped = optimizer `step` count."""


def _plan_fingerprint(plan: ParallelPlan) -> str:
    """The plan without its prediction: what decides whether per-rank state still fits."""
    data = plan.to_dict()
    data.pop("prediction", None)
    data.pop("cluster", None)
    return repr(sorted(data.items()))


def _rng_state() -> dict[str, Any]:
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and state["cuda_rng_state"] is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


# The distributed optimizer's state is saved in the layout-independent format, so a checkpoint
# loads under any other plan (Megatron-LM's --dist-ckpt-optim-fully-reshardable). Its default
# `dp_reshardable` only survives a change of the DP degree; `fully_sharded_model_space` fails in
# 0.16.1 ("ShardedTensor.flattened_range is not supported", dist_checkpointing/mapping.py:134).
DISTOPT_SHARDING = "fully_reshardable"


def _optimizer_format(optimizer: Any) -> str:
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


LAYER_KEYS = "global"
"""Recorded as megatron_ext.layer_keys: layers are saved as `decoder.layers.{i}.*` with the
global layer index `i` in the key (megatron-core's `non_homogeneous_layers`,
transformer_block.py:822), so a layer's tensors do not depend on which stage holds it or how
its neighbours are sharded; the stock GPTModel, the layerwise runtime and FlexSP all write and
read them. Checkpoints without the record (older megatron_ext, Megatron-LM) stack the layers
into one tensor per weight, `decoder.layers.*` with a layer axis: only a uniform plan reads them."""


def _metadata(backend: Backend, sharding: str = DISTOPT_SHARDING, *,
              global_layer_keys: bool = True) -> dict[str, Any]:
    """Megatron-LM's `_build_sharded_state_dict_metadata` (megatron/training/checkpointing.py), with
    per-layer keys (`LAYER_KEYS`)."""
    return {"dp_cp_group": backend.dp_cp_group, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True, "distrib_optim_sharding_type": sharding,
            "non_homogeneous_layers": global_layer_keys}


def _state_dict(backend: Backend, scheduler: Any, state: TrainState, plan: ParallelPlan, *,
                is_loading: bool, with_rng: bool = True, with_optimizer: bool = True,
                global_layer_keys: bool = True) -> dict[str, Any]:
    metadata = _metadata(backend, global_layer_keys=global_layer_keys)
    sd = backend.sharded_state_dict(metadata)
    if with_optimizer:
        sd["optimizer"] = backend.optimizer.sharded_state_dict(
            sd, is_loading=is_loading, metadata=metadata)
    sd["opt_param_scheduler"] = scheduler.state_dict()
    sd["iteration"] = state.iteration
    sd["checkpoint_version"] = CHECKPOINT_VERSION
    sd["train_state"] = asdict(state)
    sd["megatron_ext"] = {"plan": plan.to_json(), "fingerprint": _plan_fingerprint(plan),
                          "padded_vocab_size": backend.padded_vocab_size,
                          "optimizer_format": _optimizer_format(backend.optimizer),
                          "model_format": backend.chain_format, "layer_keys": LAYER_KEYS,
                          "optimizer_chain": [list(k) for k in chain_kinds(plan)]
                          if backend.chain_format == "layerwise" else None}
    if with_rng:
        rank, world = dist.get_rank(), dist.get_world_size()
        sd["rng_state"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return sd


def prewarm_checkpoint_writer(shield: tuple[int, ...] = ()) -> threading.Thread:
    """Start megatron-core's checkpoint results queue now, in the background.

    `FileSystemWriterAsync` sends write results through a spawn-context Manager
    (filesystem_async.py:51); the Manager's server process must import torch to unpickle them,
    which made the first save of a run take 10-20 s on a busy CPU box. Putting a torch object
    through the queue while the model and datasets are being built moves that cost off the
    critical path. Later saves reuse the same queue.

    `shield` (--exit-signal-handler: its signals): the Manager process is started here, with
    those signals ignored, which it inherits; a preemption signal sent to every process of the
    job (Slurm) then leaves it alive for the save that follows.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if shield:
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in shield}
        try:
            filesystem_async._get_write_results_queue()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def warm() -> None:
        try:
            queue = filesystem_async._get_write_results_queue()
            queue.put(torch.Size([0]))
            queue.get()
        except (EOFError, OSError):  # best effort: the process may be exiting already
            pass

    thread = threading.Thread(target=warm, name="megatron_ext-ckpt-prewarm", daemon=True)
    thread.start()
    return thread


def _commit(root: Path, tmp: Path, iteration: int) -> None:
    """Rank 0: publish a fully written checkpoint directory, then point the tracker at it."""
    write_manifest(tmp, iteration)  # last: a manifest means every rank's files are complete
    final = iteration_dir(root, iteration)
    if final.exists():  # an older save of the same iteration (a re-run): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    if not publish_tracker(root, iteration):
        logger.warning("%s under %s names a newer iteration than %d; left unchanged",
                       TRACKER_FILE, root, iteration)


@torch.no_grad()
def _materialize_adam_state(optimizer: Any) -> None:
    """Give torch Adam parameters that have never been stepped the state Adam's first step
    creates (step 0, zero moments; torch/optim/adam.py `_init_group`), so a save before the
    first successful step works: without apex/TE, megatron's DistributedOptimizer.state_dict
    asserts one shared `step` (distrib_optimizer.py:642), and under fp16 every step before the
    loss scale has come down is skipped. Adam then behaves exactly as with lazy state."""
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if inner.state[param]:
                    continue
                inner.state[param] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
                if group.get("amsgrad"):
                    inner.state[param]["max_exp_avg_sq"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format)


def save_checkpoint(root: str | Path, backend: Backend, scheduler: Any, state: TrainState,
                    plan: ParallelPlan, *, with_optimizer: bool = True) -> Path:
    """Write iteration `state.iteration` under `root`; returns the published directory.
    `with_optimizer=False`: Megatron-LM's --no-save-optim (weights, scheduler, RNG only)."""
    root = Path(root)
    tmp = root / f"iter_{state.iteration:07d}.tmp"
    if dist.get_rank() == 0:
        if tmp.exists():  # left over by a run killed mid-save
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    if with_optimizer:
        _materialize_adam_state(backend.optimizer)
    sd = _state_dict(backend, scheduler, state, plan, is_loading=False,
                     with_optimizer=with_optimizer)
    dist_checkpointing.save(sd, str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        _commit(root, tmp, state.iteration)
    dist.barrier()
    return iteration_dir(root, state.iteration)


def checkpoint_info(target: LoadTarget | str | Path | None) -> dict[str, Any] | None:
    """megatron_ext's record (plan, padded_vocab_size, model_format, ...) of the checkpoint
    `target` names (checkpoint_files.resolve_load; a directory: its latest), or None when there
    is none."""
    if not isinstance(target, LoadTarget):
        target = resolve_load(target)
    if target is None:
        return None
    common = dist_checkpointing.load_common_state_dict(str(target.directory))
    return dict(common["megatron_ext"])


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
    record) cannot be restored under `plan`; checked before any model group.

    The moments are keyed by the parameters' own (global layer) keys, so they reshard like the
    weights, and one optimizer per rank reloads under any plan (stock, FlexSP, or a layerwise
    plan with one gradient class per stage); but megatron-core's ChainedOptimizer keeps one
    entry per chained optimizer, with its param groups in the checkpoint's common (rank-0) part,
    and reloads only into the same number of optimizers per stage (optimizer.py:1218). Weights
    reshard under any plan (--no-load-optim keeps them and restarts the moments).
    """
    from megatron_ext.megatron_adapter.training.select import chain_format

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


def check_layer_keys(info: dict[str, Any], plan: ParallelPlan, root: str | Path) -> None:
    """One-line PlanError when a checkpoint with stacked layer keys (`LAYER_KEYS`) is loaded
    under a plan the stock backend cannot run."""
    from megatron_ext.megatron_adapter.training.select import stock_unsupported_reason

    reason = stock_unsupported_reason(plan)
    if info.get("layer_keys") != LAYER_KEYS and reason is not None and plan.flexsp is None:
        raise PlanError(
            f"--load={root} stacks its layers into one tensor per weight (written by Megatron-LM "
            f"or an older megatron_ext); this plan needs the layerwise runtime ({reason}), "
            "which reads per-layer keys: resume it once under a uniform plan and save, then "
            "load that checkpoint")


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _ensure_distopt_state(optimizer: Any) -> None:
    """Give a never-stepped DistributedOptimizer a state to load into.

    Without TE/apex its `state_dict()` asserts one shared `step` (distrib_optimizer.py:642),
    which an empty torch Adam state does not have. megatron-core's own dummy initialisation
    steps on zero grads; its effect on the weights is overwritten by the model load that
    follows, and `_fix_adam_step` then sets the real step count.
    """
    for opt in _inner_optimizers(optimizer):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None and not getattr(opt.optimizer, "state", True):
            init()


@contextlib.contextmanager
def _tolerate_missing_step(optimizer: Any) -> Iterator[None]:
    """Load `fully_reshardable` distributed-optimizer state into torch Adam.

    The checkpoint holds param/exp_avg/exp_avg_sq per parameter, but the copy loop copies every
    key of the live state, including torch Adam's per-parameter `step`, and raises
    KeyError('step') (megatron/core/optimizer/distrib_optimizer.py:940). For the duration of
    the load, `step` is set aside around each copy; `_fix_adam_step` sets it afterwards.
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


def _fix_adam_step(optimizer: Any, num_steps: int) -> None:
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


def load_checkpoint(target: LoadTarget, backend: Backend, scheduler: Any, plan: ParallelPlan, *,
                    load_optimizer: bool = True, load_rng: bool = True) -> TrainState:
    """Restore the checkpoint `target` names (checkpoint_files.resolve_load verified it)."""
    root, iteration = target.root, target.iteration
    ckpt_dir = str(target.directory)
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    global_layer_keys = common["megatron_ext"].get("layer_keys") == LAYER_KEYS
    same_plan = common["megatron_ext"]["fingerprint"] == _plan_fingerprint(plan)
    with_rng = load_rng and same_plan
    saved_format = common["megatron_ext"]["optimizer_format"]  # rank 0's (the common part)
    chain = common["megatron_ext"].get("optimizer_chain")
    if chain and backend.chain_format == "layerwise" and len(chain) == plan.pp:
        # this rank's stage as saved: stages may chain different kinds (check_optimizer_layout
        # compared the chains stage by stage)
        saved_format = "+".join(sorted(set(chain[dist.get_rank() // plan.stage_width])))
    if load_optimizer and saved_format != _optimizer_format(backend.optimizer):
        raise PlanError(
            f"--load={root} holds {saved_format} optimizer state but this plan uses the "
            f"{_optimizer_format(backend.optimizer)} optimizer (the ZeRO level changed); add "
            "--no-load-optim to restart the optimizer moments, or keep the ZeRO level")
    if load_optimizer:
        _ensure_distopt_state(backend.optimizer)
    sd = _state_dict(backend, scheduler, TrainState(), plan, is_loading=True, with_rng=with_rng,
                     with_optimizer=load_optimizer, global_layer_keys=global_layer_keys)
    loaded = dist_checkpointing.load(sd, ckpt_dir)
    backend.load_model_state(loaded)
    state = TrainState(**loaded["train_state"])
    if load_optimizer:
        # no_grad: distopt copies into views of leaf params (distrib_optimizer.py:940)
        with torch.no_grad(), _tolerate_missing_step(backend.optimizer):
            backend.optimizer.load_state_dict(loaded["optimizer"])
        if "distributed" in saved_format:
            _fix_adam_step(backend.optimizer, state.iteration - state.skipped_iterations)
        try:
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
        except AssertionError as err:  # megatron-core asserts that the schedule flags match
            raise PlanError(f"--load={root}: {err}; keep the learning-rate flags of the run that "
                            "wrote it, or pass --override-opt_param-scheduler") from None
    if with_rng:
        _set_rng_state(loaded["rng_state"])
    if dist.get_rank() == 0:
        logger.info("loaded %s (iteration %d%s)", ckpt_dir, iteration,
                    "" if same_plan else "; written under a different plan: weights and "
                    "optimizer resharded, RNG streams start fresh")
    return state
