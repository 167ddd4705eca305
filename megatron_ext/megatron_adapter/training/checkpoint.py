"""Checkpoints with megatron-core `dist_checkpointing`, loadable under any other plan.

Layout (Megatron-LM's): `SAVE/iter_0000010/` (torch_dist shards + common.pt) and
`SAVE/latest_checkpointed_iteration.txt`. A save writes into `iter_0000010.tmp/`, and only after
every rank has finished does rank 0 rename it and then replace the tracker file atomically; a run
killed mid-save therefore leaves the previous checkpoint as the latest complete one.

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
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_ext.errors import PlanError
from megatron_ext.plan import ParallelPlan

logger = logging.getLogger(__name__)
TRACKER_FILE = "latest_checkpointed_iteration.txt"
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


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def read_tracker(root: str | Path) -> int | None:
    """The last completely written iteration under `root`, or None when there is none."""
    tracker = Path(root) / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise PlanError(f"{tracker} holds {text!r}, not an iteration number; fix or delete it")
    return int(text)


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
# 0.16.1 (mcore_cpu.md section 8.4).
DISTOPT_SHARDING = "fully_reshardable"


def _optimizer_format(optimizer: Any) -> str:
    """'distributed' (ZeRO-1 state: per-parameter fp32 main copy + moments), 'local', or both
    ('distributed+local') when a heterogeneous plan mixes ZeRO levels."""
    kinds = {"distributed" if getattr(opt.config, "use_distributed_optimizer", False) else "local"
             for opt in _inner_optimizers(optimizer)}
    return "+".join(sorted(kinds))


def _metadata(backend: Any, sharding: str = DISTOPT_SHARDING) -> dict[str, Any]:
    """Megatron-LM's `_build_sharded_state_dict_metadata` (mcore_cpu.md section 8.3)."""
    return {"dp_cp_group": backend.dp_cp_group, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True, "distrib_optim_sharding_type": sharding}


def _state_dict(backend: Any, scheduler: Any, state: TrainState, plan: ParallelPlan, *,
                is_loading: bool, with_rng: bool = True,
                with_optimizer: bool = True) -> dict[str, Any]:
    metadata = _metadata(backend)
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
                          "model_format": backend.model_format}
    if with_rng:
        rank, world = dist.get_rank(), dist.get_world_size()
        sd["rng_state"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return sd


def prewarm_checkpoint_writer() -> threading.Thread:
    """Start megatron-core's checkpoint results queue now, in the background.

    `FileSystemWriterAsync` sends write results through a spawn-context Manager
    (filesystem_async.py:51); the Manager's server process must import torch to unpickle them,
    which made the first save of a run take 10-20 s on a busy CPU box. Putting a torch object
    through the queue while the model and datasets are being built moves that cost off the
    critical path. Later saves reuse the same queue.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

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
    final = iteration_dir(root, iteration)
    if final.exists():  # an older save of the same iteration (a re-run): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    tracker_tmp = root / (TRACKER_FILE + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker_tmp, root / TRACKER_FILE)


def save_checkpoint(root: str | Path, backend: Any, scheduler: Any, state: TrainState,
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
    sd = _state_dict(backend, scheduler, state, plan, is_loading=False,
                     with_optimizer=with_optimizer)
    dist_checkpointing.save(sd, str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        _commit(root, tmp, state.iteration)
    dist.barrier()
    return iteration_dir(root, state.iteration)


def checkpoint_info(root: str | Path) -> dict[str, Any] | None:
    """megatron_ext's record (plan, padded_vocab_size, model_format, ...) of the latest
    checkpoint under `root`, or None when there is none."""
    iteration = read_tracker(root)
    if iteration is None:
        return None
    common = dist_checkpointing.load_common_state_dict(str(iteration_dir(root, iteration)))
    return dict(common["megatron_ext"])


def gradient_class_counts(plan: ParallelPlan) -> tuple[int, ...]:
    """Per pipeline stage, how many optimizers the layerwise runtime chains there.

    Mirrors ddp.grad_classes: one class per distinct (tp, zero) among the stage's embedding
    (first stage), layers, final norm and output layer (last stage), or its vocabulary shards
    (vocabulary parallelism, every stage). Pure: computed from the plan alone, before any group.
    """
    counts = []
    vocab_parallel = plan.vocab.mode == "vocab_parallel"
    for stage, (start, end) in enumerate(plan.stages):
        keys = {(s.tp, s.zero) for s in plan.layers[start:end]}
        if stage == plan.pp - 1:  # final norm (and the output layer unless vocab-parallel)
            keys.add((plan.vocab.tp, plan.layers[end - 1].zero))
        if (stage == 0 and not vocab_parallel) or vocab_parallel:  # embedding / vocab shards
            keys.add((plan.vocab.tp, plan.layers[start].zero))
        counts.append(len(keys))
    return tuple(counts)


def check_optimizer_layout(info: dict[str, Any], plan: ParallelPlan, root: str | Path) -> None:
    """One-line PlanError when a layerwise checkpoint's optimizer state (`info`: its
    checkpoint_info record) cannot be restored under `plan`; checked before any model group.

    megatron-core's ChainedOptimizer keys its state by optimizer index and keeps param groups in
    the checkpoint's common (rank-0) part, so it reloads only into the same chain per stage;
    weights reshard under any plan (--no-load-optim keeps them and restarts the moments).
    """
    if info.get("model_format", "megatron") != "layerwise":
        return  # stock format: one optimizer per rank, resharded by megatron-core
    saved = ParallelPlan.from_dict(json.loads(info["plan"]))
    was, now = gradient_class_counts(saved), gradient_class_counts(plan)
    if was != now:
        raise PlanError(
            f"--load={root} holds optimizer state of a plan with {list(was)} gradient classes "
            f"per pipeline stage, this plan has {list(now)}; megatron-core's chained optimizer "
            "cannot reshard between them: add --no-load-optim (weights still load) or resume "
            "under the saved plan")


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
    KeyError('step') (distrib_optimizer.py:940, mcore_cpu.md section 8.5). For the duration of
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
    (mcore_cpu.md section 8.5): every parameter has been stepped `num_steps` times."""
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None or not hasattr(inner, "state"):
            continue
        for param_state in inner.state.values():
            if "step" in param_state:
                step = param_state["step"]
                param_state["step"] = (torch.full_like(step, float(num_steps))
                                       if torch.is_tensor(step) else num_steps)


def load_checkpoint(root: str | Path, backend: Any, scheduler: Any, plan: ParallelPlan, *,
                    load_optimizer: bool = True, load_rng: bool = True) -> TrainState | None:
    """Restore the latest checkpoint under `root`; None (and nothing changed) when there is none."""
    iteration = read_tracker(root)
    if iteration is None:
        if dist.get_rank() == 0:
            logger.warning("no %s under --load=%s; starting from scratch", TRACKER_FILE, root)
        return None
    ckpt_dir = str(iteration_dir(root, iteration))
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    same_plan = common["megatron_ext"]["fingerprint"] == _plan_fingerprint(plan)
    with_rng = load_rng and same_plan
    saved_format = common["megatron_ext"]["optimizer_format"]
    if load_optimizer and saved_format != _optimizer_format(backend.optimizer):
        raise PlanError(
            f"--load={root} holds {saved_format} optimizer state but this plan uses the "
            f"{_optimizer_format(backend.optimizer)} optimizer (the ZeRO level changed); add "
            "--no-load-optim to restart the optimizer moments, or keep the ZeRO level")
    if load_optimizer:
        _ensure_distopt_state(backend.optimizer)
    sd = _state_dict(backend, scheduler, TrainState(), plan, is_loading=True, with_rng=with_rng,
                     with_optimizer=load_optimizer)
    loaded = dist_checkpointing.load(sd, ckpt_dir)
    backend.load_model_state(loaded)
    state = TrainState(**loaded["train_state"])
    if load_optimizer:
        # no_grad: distopt copies into views of leaf params (mcore_cpu.md 8.5)
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
