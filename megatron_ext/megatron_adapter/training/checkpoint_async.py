"""--async-save: Megatron-LM's asynchronous torch_dist saves (megatron/training/async_utils.py).

A save prepares its shards on the training ranks, hands the write to a background writer and
returns; training continues while the files are written. `AsyncSaver.maybe_finalize` is polled
after every step (Megatron-LM's `maybe_finalize_async_save(blocking=False)`, one small
all-reduce): once every rank's writer has finished, the save is finalized on every rank at the
same step, which is when checkpoint.py's commit runs: megatron-core's metadata, the manifest,
the rename of `iter_*.tmp` and the tracker. Until then the tracker names the previous
checkpoint, so a crash or SIGTERM while a write is in flight leaves that one intact and
resumable. Every way out of `train` (the last iteration, --exit-interval,
--exit-duration-in-mins, --exit-signal-handler) finalizes with `blocking=True` before it returns.

The writer is megatron-core's `AsyncCallsQueue`: a process forked per save
(`TemporalAsyncCaller`, Megatron-LM's default) or, with --use-persistent-ckpt-worker, one
spawned worker kept for the whole run (`PersistentAsyncCaller`).

CPU (gloo) runs: megatron-core's persistent worker starts with
`torch.cuda.set_device(rank % torch.cuda.device_count())`, a division by zero without CUDA;
`_CpuPersistentCaller` starts the same worker loop in a process that first makes those two calls
harmless (patches/README.md, `persistent_ckpt_worker`). The worker is started with the
--exit-signal-handler signals ignored, as the checkpoint writer's results queue is
(checkpoint.prewarm_checkpoint_writer), so a preemption signal sent to every process of the job
leaves it alive for the save that follows.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
)
from torch import multiprocessing as mp

__all__ = ["AsyncSaver"]
logger = logging.getLogger(__name__)


def _cpu_snapshot(preload: Callable[[], Any]) -> Any:
    """The persistent worker's preload on CPU: megatron-core's copies GPU tensors to the host,
    which snapshots them; CPU tensors arrive as the trainer's own (shared) storage, which the
    next steps update in place, so they are cloned while the trainer waits for the preload."""
    return [(path, key, (data, [(item, tensor.clone()) for item, tensor in tensors]))
            for path, key, (data, tensors) in preload()]


def _cpu_worker_loop(*args: Any) -> None:
    """megatron-core's persistent worker loop, in a process without CUDA: megatron_ext's CPU
    patches (megatron_adapter/cpu) as in the training ranks, and the loop's first line
    (`torch.cuda.set_device(rank % torch.cuda.device_count())`) made a no-op."""
    if not torch.cuda.is_available():
        from megatron_ext.megatron_adapter.cpu import compat

        compat.apply()
        torch.cuda.device_count = lambda: 1  # type: ignore[assignment]
        torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
    PersistentAsyncCaller.async_loop(*args)


class _CpuPersistentCaller(PersistentAsyncCaller):  # type: ignore[misc]
    """PersistentAsyncCaller whose worker starts through `_cpu_worker_loop`, shielded from
    `shield` (the --exit-signal-handler signals)."""

    def __init__(self, shield: tuple[int, ...]) -> None:
        super().__init__()
        self.shield = shield

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        process: Any = self.process  # type: ignore[has-type]
        if process is None and async_req.async_fn is not None:
            previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in self.shield}
            try:
                process = mp.get_context("spawn").Process(
                    target=_cpu_worker_loop,
                    args=(dist.get_rank(), self.queue, self.preload_q, self.comp_q,
                          logger.getEffectiveLevel()))
                process.start()
                self.process = process
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        super().schedule_async_call(async_req)


class _Queue(AsyncCallsQueue):  # type: ignore[misc]
    def __init__(self, persistent: bool, shield: tuple[int, ...]) -> None:
        super().__init__(persistent=persistent)
        self.shield = shield

    def _get_async_caller(self) -> AsyncCaller:
        caller: Any = self.persistent_caller  # type: ignore[has-type]
        if self.persistent and caller is None:
            self.persistent_caller = _CpuPersistentCaller(self.shield)
        return super()._get_async_caller()


class AsyncSaver:
    """The run's asynchronous saves: `schedule` one, `maybe_finalize` after every step (all
    ranks), `close` once at the end (waits for what is in flight)."""

    def __init__(self, *, persistent: bool = False, shield: tuple[int, ...] = ()) -> None:
        self.queue = _Queue(persistent, shield)

    @property
    def in_flight(self) -> int:
        """Saves scheduled and not finalized yet (the same on every rank)."""
        return int(self.queue.get_num_unfinalized_calls())

    def schedule(self, request: AsyncRequest, finalize: Callable[[], None]) -> None:
        """Start writing `request` in the background; `finalize` (collective, every rank) runs
        in place of the request's own finalize functions once every rank's write finished."""
        if self.in_flight and dist.get_rank() == 0:
            logger.warning("starting a checkpoint save before the previous one has finished; "
                           "consider a longer --save-interval")
        if self.queue.persistent and request.preload_fn and not torch.cuda.is_available():
            request = request._replace(preload_fn=partial(_cpu_snapshot, request.preload_fn))
        self.queue.schedule_async_request(request._replace(finalize_fns=[finalize]))

    def maybe_finalize(self, *, blocking: bool = False) -> list[int]:
        """Collective: finalize the saves whose writes finished on every rank (all of them,
        waiting, with `blocking`)."""
        if blocking and self.in_flight and dist.get_rank() == 0:
            logger.info("waiting for the checkpoint save in flight to finish")
        return list(self.queue.maybe_finalize_async_calls(blocking=blocking, no_dist=False))

    def close(self, *, abort: bool = False) -> None:
        """Finalize what is in flight (collective), then stop the persistent worker;
        `abort` (the run is failing, other ranks may not take part): stop the writers at once
        without finalizing, so the tracker keeps naming the last finalized checkpoint."""
        if abort:  # megatron-core's close(abort=True) stops only the persistent worker
            for call in self.queue.async_calls:
                call.async_caller.close(abort=True)
            self.queue.async_calls.clear()
        self.queue.close(abort=abort)
