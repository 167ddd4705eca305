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

import torch.distributed as dist
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
