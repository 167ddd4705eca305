"""A save that cannot write (disk full, I/O error, permissions) ends the run with one line.

Every rank takes part in each step of a save (create the directory, write the shards, publish),
and after each step all ranks agree on whether any of them failed (`agree`, one small
all-gather), so a failure on one rank is the same one-line `CheckpointWriteError` on every rank
instead of a hang or a traceback per rank. The line names the directory being written, the
cause (the OSError's errno, found in megatron-core's and torch's wrapped exceptions, or a full
file system found by `statvfs` when the writer only reports a short write), the bytes written,
and the iteration the tracker still names: the partial `iter_*.tmp` directory is never
published (checkpoint.py), so the last good checkpoint resumes.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.training.checkpoint_files import TRACKER_FILE, read_tracker

SAVE_ERRORS = (Exception, CheckpointException)
"""What a failed write raises: torch's CheckpointException (megatron-core's writer gathers every
rank's failure into one) derives from BaseException, not Exception."""
FULL_BELOW_BYTES = 1 << 20
"""A file system with less free space than this after a failed write is taken to be full."""


class CheckpointWriteError(PlanError):
    """A checkpoint could not be written; one line (module docstring)."""


def _oserror(err: BaseException, depth: int = 0) -> OSError | None:
    """The first OSError with an errno in `err`, its causes, or (torch's CheckpointException,
    megatron's CheckpointingException) the per-rank failures it carries."""
    if depth > 8 or err is None:
        return None
    if isinstance(err, OSError) and err.errno:
        return err
    nested = [err.__cause__, err.__context__]
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):  # torch: rank -> (exception, stack summary)
        for failure in failures.values():
            failure = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(failure, BaseException):
                nested.append(failure)
    for inner in nested:
        found = _oserror(inner, depth + 1) if inner is not None else None
        if found is not None:
            return found
    return None


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def cause_of(err: BaseException, path: Path) -> str:
    """What went wrong, in a few words with the errno name where there is one."""
    found = _oserror(err)
    if found is not None and found.errno is not None:
        return f"{os.strerror(found.errno)} ({errno.errorcode.get(found.errno, found.errno)})"
    try:
        stat = os.statvfs(_existing(path))
        free = stat.f_bavail * stat.f_frsize
    except OSError:
        free = None
    if free is not None and free < FULL_BELOW_BYTES:
        return f"{os.strerror(errno.ENOSPC)} (ENOSPC, {free} bytes free)"
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return f"{type(err).__name__}: {first[:200]}"


def bytes_under(path: Path) -> int:
    total = 0
    for name in path.rglob("*") if path.is_dir() else []:
        try:
            total += name.stat().st_size if name.is_file() else 0
        except OSError:
            pass
    return total


def describe(err: BaseException, root: Path, tmp: Path, iteration: int) -> str:
    try:
        previous = read_tracker(root)
    except PlanError:
        previous = None
    resume = (f"{TRACKER_FILE} still names iteration {previous}, which resumes with --load "
              f"{root}" if previous is not None else "no earlier checkpoint was published there")
    return (f"could not save iteration {iteration} to {tmp}: {cause_of(err, tmp)}, after "
            f"{bytes_under(tmp)} bytes were written; {resume}; free space or fix the path "
            "(--save), then resume")


def agree(error: str | None) -> str | None:
    """Collective: the error of the lowest rank that had one, on every rank (None: none)."""
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    return next((e for e in gathered if e is not None), None)


def discard(tmp: Path) -> None:
    """Rank 0, after a failed save: remove the partial directory (frees what it held)."""
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)


class MetadataFailureSafeStrategy(TorchDistSaveShardedStrategy):  # type: ignore[misc]
    """megatron-core's torch_dist save strategy, with the coordinator's metadata write made
    collective-safe.

    megatron-core's finalize (`save_state_dict_async_finalize`, state_dict_saver.py) gathers
    every rank's write results, lets the coordinator write `.metadata` (`storage_writer.finish`)
    and then broadcasts whether anything failed; `dist_checkpointing.save` then ends with a
    barrier. When the metadata write itself fails (a disk that fills just then), the coordinator
    raised before that broadcast and every other rank waited in it for ever. Here the
    coordinator's `finish` error is kept instead, megatron-core's collectives all run, and the
    caller raises it with `raise_kept_error()` once `save` (or, for an async save, every
    finalize function) returned: every rank then reaches `agree` together and the save ends in
    the one line of any other write failure.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kept: list[BaseException] = []

    def _get_save_and_finalize_callbacks(self, writer: Any, save_state_dict_ret: Any,
                                         *args: Any) -> Any:
        finish = writer.finish

        def finish_keeping_the_error(*f_args: Any, **f_kwargs: Any) -> Any:
            try:
                return finish(*f_args, **f_kwargs)
            except SAVE_ERRORS as err:
                self._kept.append(err)
                return None

        writer.finish = finish_keeping_the_error
        return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret, *args)

    def raise_kept_error(self) -> None:
        """Raise the metadata-write error of the last save, if it had one (coordinator only)."""
        if self._kept:
            err = self._kept.pop()
            self._kept.clear()
            raise err


def save_strategy(*, cached: bool) -> MetadataFailureSafeStrategy:
    """The torch_dist save strategy for every save (`cached`: --ckpt-assume-constant-structure,
    the save plan cached after the first save, as Megatron-LM's checkpointing context keeps it)."""
    strategy = MetadataFailureSafeStrategy("torch_dist", 1)
    strategy.use_cached_ckpt_structure = cached
    return strategy
