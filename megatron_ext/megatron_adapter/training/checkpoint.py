"""Checkpoints with megatron-core `dist_checkpointing`, loadable under any other plan.

Layout (Megatron-LM's): `SAVE/iter_0000010/` (torch_dist shards + common.pt) and
`SAVE/latest_checkpointed_iteration.txt`. A save writes into `iter_0000010.tmp/`, and only after
every rank has finished does rank 0 write the manifest (checkpoint_files.py), rename the
directory and then replace the tracker file atomically (never with an older iteration); a run
killed mid-save therefore leaves the previous checkpoint as the latest complete one. Loading
verifies the directory against its manifest first (`resolve_load`, before any process group).

Tensors are keyed by global layer index (`decoder.layers.7...`), so a different TP/PP/DP layout
reshards on load; so is the optimizer state, per parameter (checkpoint_optim.py), whatever
optimizers the plan chains. RNG states are per rank and restored only when the plan is
unchanged; the data position is a sample count and is restored under any plan.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import shutil
import signal
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, package_info, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.ddp import force_param_sync
from megatron_ext.megatron_adapter.training import checkpoint_optim, checkpoint_write
from megatron_ext.megatron_adapter.training.checkpoint_files import (
    TRACKER_FILE,
    LoadTarget,
    iteration_dir,
    publish_tracker,
    resolve_load,
    write_manifest,
)
from megatron_ext.megatron_adapter.training.checkpoint_legacy import (
    DISTOPT_SHARDING,
    check_legacy_format,
    check_optimizer_layout,
    ensure_distopt_state,
    gradient_class_counts,
    restore_legacy,
)
from megatron_ext.megatron_adapter.training.checkpoint_optim import PARAM_KEYED
from megatron_ext.plan import ParallelPlan

if TYPE_CHECKING:
    from megatron_ext.megatron_adapter.training.backend import Backend
    from megatron_ext.megatron_adapter.training.checkpoint_async import AsyncSaver

__all__ = ["TrainState", "check_layer_keys", "check_optimizer_layout",
           "checkpoint_info", "gradient_class_counts", "load_checkpoint",
           "prewarm_checkpoint_writer", "save_checkpoint"]
logger = logging.getLogger(__name__)
_SLOTS = "megatron_ext.optimizer_slots"
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
                is_loading: bool, with_rng: bool = True, optimizer: str | None = PARAM_KEYED,
                global_layer_keys: bool = True, saved_keys: set[str] | None = None,
                root: str | Path = "") -> dict[str, Any]:
    """`optimizer`: PARAM_KEYED (checkpoint_optim.py), "legacy" (megatron-core's chained
    layout, checkpoints written before it) or None (no optimizer state); `saved_keys`: the
    checkpoint's tensor keys (loading PARAM_KEYED)."""
    metadata = _metadata(backend, global_layer_keys=global_layer_keys)
    sd = backend.sharded_state_dict(metadata)
    if optimizer == PARAM_KEYED and is_loading:
        sd["optimizer"], slots = checkpoint_optim.load_request(
            backend.optimizer, sd, saved_keys or set(), str(root))
        sd[_SLOTS] = slots  # taken out again before dist_checkpointing.load
    elif optimizer == PARAM_KEYED:
        sd["optimizer"] = checkpoint_optim.save_state(backend.optimizer, sd)
    elif optimizer == "legacy":
        sd["optimizer"] = backend.optimizer.sharded_state_dict(
            sd, is_loading=is_loading, metadata=metadata)
    sd["opt_param_scheduler"] = scheduler.state_dict()
    sd["iteration"] = state.iteration
    sd["checkpoint_version"] = CHECKPOINT_VERSION
    sd["train_state"] = asdict(state)
    sd["megatron_ext"] = {"plan": plan.to_json(), "fingerprint": _plan_fingerprint(plan),
                          "padded_vocab_size": backend.padded_vocab_size,
                          "optimizer_layout": PARAM_KEYED,
                          "megatron_core_version": package_info.__version__,
                          "model_format": backend.chain_format, "layer_keys": LAYER_KEYS}
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
    from megatron_ext.megatron_adapter.compat import write_results_queue

    if shield:
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in shield}
        try:
            write_results_queue()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def warm() -> None:
        try:
            queue = write_results_queue()
            queue.put(torch.Size([0]))
            queue.get()
        except (EOFError, OSError):  # best effort: the process may be exiting already
            pass

    thread = threading.Thread(target=warm, name="megatron_ext-ckpt-prewarm", daemon=True)
    thread.start()
    _PREWARMING.append(thread)
    # A run that fails while the Manager is still starting (in this thread) would otherwise
    # hang at exit: multiprocessing's exit handler joins the half-started Manager process, whose
    # shutdown finalizer is registered only once its start returns. atexit runs this first
    # (handlers run last-registered first), so the finalizer exists when that join comes.
    atexit.register(_wait_for_prewarm)
    return thread


_PREWARMING: list[threading.Thread] = []
"""Prewarm threads still to be waited for: a save must not put its results into the queue while
the prewarm's object is still being unpickled there, or the Manager's server imports torch in
two threads at once and fails ("'torch._C' is not a package")."""


def _wait_for_prewarm() -> None:
    while _PREWARMING:
        _PREWARMING.pop().join()


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


def save_checkpoint(root: str | Path, backend: Backend, scheduler: Any, state: TrainState,
                    plan: ParallelPlan, *, with_optimizer: bool = True,
                    saver: AsyncSaver | None = None,
                    strategy: checkpoint_write.MetadataFailureSafeStrategy | None = None) -> Path:
    """Write iteration `state.iteration` under `root`; returns the directory it is published
    as. `with_optimizer=False`: Megatron-LM's --no-save-optim (weights, scheduler, RNG only).
    `saver` (--async-save): the shards are written in the background and the directory is
    published when `saver` finalizes the save (checkpoint_async.py), every rank's write done.
    A write that fails on any rank is one CheckpointWriteError line on every rank
    (checkpoint_write.py), raised here or, for an async save, by the finalize; the tracker keeps
    naming the last complete checkpoint. `strategy`: `checkpoint_write.save_strategy(cached=True)`
    for --ckpt-assume-constant-structure, or None (planned anew each save)."""
    root = Path(root)
    strategy = checkpoint_write.save_strategy(cached=False) if strategy is None else strategy
    iteration = state.iteration  # `state` moves on while an async save is in flight
    tmp = root / f"iter_{iteration:07d}.tmp"

    def step(action: Any, on_rank0_only: bool) -> None:
        """Run `action`; every rank raises the same one line if it failed on any rank."""
        error = None
        if dist.get_rank() == 0 or not on_rank0_only:
            try:
                action()
            except checkpoint_write.SAVE_ERRORS as err:  # OSError, or the writer's wrapped one
                error = checkpoint_write.describe(err, root, tmp, iteration)
        error = checkpoint_write.agree(error)
        if error is not None:
            checkpoint_write.discard(tmp)
            raise checkpoint_write.CheckpointWriteError(error)

    def prepare() -> None:
        if tmp.exists():  # left over by a run killed mid-save
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    step(prepare, on_rank0_only=True)
    _wait_for_prewarm()  # also before an async save: its writer sends results through the queue
    force_param_sync(backend.model)  # --overlap-param-gather: no rank may save stale shards
    sd = _state_dict(backend, scheduler, state, plan, is_loading=False,
                     optimizer=PARAM_KEYED if with_optimizer else None)
    if saver is None:
        def save() -> None:
            dist_checkpointing.save(sd, str(tmp), sharded_strategy=strategy)
            strategy.raise_kept_error()

        step(save, on_rank0_only=False)
        step(lambda: _commit(root, tmp, iteration), on_rank0_only=True)
        return iteration_dir(root, iteration)
    requests: list[Any] = []
    step(lambda: requests.append(dist_checkpointing.save(
        sd, str(tmp), sharded_strategy=strategy, async_sharded_save=True)),
        on_rank0_only=False)
    finalize_fns = list(requests[0].finalize_fns)  # megatron-core's: metadata of every rank

    def finalize() -> None:  # every rank, once every rank's writer finished
        def run_finalize_fns() -> None:
            for fn in finalize_fns:
                fn()
            strategy.raise_kept_error()

        step(run_finalize_fns, on_rank0_only=False)
        step(lambda: _commit(root, tmp, iteration), on_rank0_only=True)
        if dist.get_rank() == 0:
            logger.info("checkpoint of iteration %d published under %s", iteration, root)

    saver.schedule(requests[0], finalize)
    return iteration_dir(root, iteration)


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




def load_summary(*, same_plan: bool, load_optimizer: bool, load_rng: bool, with_rng: bool,
                 finetune: bool, iteration: int, schedule_samples: int) -> str:
    """What a load restored and what restarted, as Megatron-LM's load_checkpoint decides it for
    the same flags: --no-load-optim restarts the optimizer state and the learning-rate schedule
    (it keeps the iteration and consumed samples); --finetune also restarts the iteration, the
    consumed samples and the RNG states."""
    flag = "--finetune" if finetune else "--no-load-optim"

    def restored(what: str, loaded: bool, why: str) -> str:
        return f"{what} {'restored' if loaded else f'restarted ({why})'}"

    rng_why = ("--finetune" if finetune else "--no-load-rng") if not load_rng else (
        "saved under another plan, and they are per rank")
    return "; ".join([
        "weights restored" + ("" if same_plan else " (resharded from another plan)"),
        restored("optimizer state", load_optimizer, flag)
        + ("" if same_plan or not load_optimizer else " (resharded)"),
        f"learning-rate schedule restored (at sample {schedule_samples})" if load_optimizer
        else f"learning-rate schedule restarted ({flag})",
        f"iteration {iteration} and consumed samples restored" if not finetune else
        f"iteration and consumed samples restarted at 0 (--finetune, saved at {iteration})",
        restored("RNG states", with_rng, rng_why)])


def load_checkpoint(target: LoadTarget, backend: Backend, scheduler: Any, plan: ParallelPlan, *,
                    load_optimizer: bool = True, load_rng: bool = True,
                    finetune: bool = False) -> TrainState:
    """Restore the checkpoint `target` names (checkpoint_files.resolve_load verified it), as
    Megatron-LM's load_checkpoint (megatron/training/checkpointing.py) does for the same flags:
    weights always; optimizer state and the learning-rate schedule unless
    `load_optimizer=False` (--no-load-optim, --finetune); RNG states unless `load_rng=False`
    (--no-load-rng, --finetune) and only under the same plan (they are per rank); the
    iteration and consumed samples unless `finetune` (then a fresh TrainState is returned)."""
    root, iteration = target.root, target.iteration
    ckpt_dir = str(target.directory)
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    record = common["megatron_ext"]
    global_layer_keys = record.get("layer_keys") == LAYER_KEYS
    same_plan = record["fingerprint"] == _plan_fingerprint(plan)
    with_rng = load_rng and same_plan
    layout = None
    if load_optimizer:
        if "optimizer" not in common:
            raise PlanError(f"--load={root}: iteration {iteration} was saved without optimizer "
                            "state (--no-save-optim); add --no-load-optim or --finetune")
        layout = PARAM_KEYED if record.get("optimizer_layout") == PARAM_KEYED else "legacy"
    saved_keys = None
    if layout == PARAM_KEYED:
        saved_keys = set(dist_checkpointing.load_tensors_metadata(ckpt_dir))
    elif layout == "legacy":
        saved_format = check_legacy_format(common, backend, plan, root, dist.get_rank())
        ensure_distopt_state(backend.optimizer)
    sd = _state_dict(backend, scheduler, TrainState(), plan, is_loading=True, with_rng=with_rng,
                     optimizer=layout, global_layer_keys=global_layer_keys,
                     saved_keys=saved_keys, root=root)
    slots = sd.pop(_SLOTS, None)
    loaded = dist_checkpointing.load(sd, ckpt_dir)
    backend.load_model_state(loaded)
    state = TrainState(**loaded["train_state"])
    if layout == PARAM_KEYED:
        checkpoint_optim.restore(backend.optimizer, slots, loaded["optimizer"])
    elif layout == "legacy":
        restore_legacy(backend, loaded["optimizer"], saved_format,
                       state.iteration - state.skipped_iterations)
    if load_optimizer:
        try:
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
        except AssertionError as err:  # megatron-core asserts that the schedule flags match
            raise PlanError(f"--load={root}: {err}; keep the learning-rate flags of the run that "
                            "wrote it, or pass --override-opt_param-scheduler") from None
    if with_rng:
        _set_rng_state(loaded["rng_state"])
    if dist.get_rank() == 0:
        logger.info("loaded %s: %s", ckpt_dir, load_summary(
            same_plan=same_plan, load_optimizer=load_optimizer, load_rng=load_rng,
            with_rng=with_rng, finetune=finetune, iteration=iteration,
            schedule_samples=scheduler.num_steps))
    return TrainState() if finetune else state

