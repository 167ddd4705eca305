"""The one line a failed checkpoint write ends with: the cause found inside the exceptions
megatron-core's writer and torch wrap it in, the bytes written, and the checkpoint that
resumes (a full file system end to end: tests/dist/test_checkpoint_ops.py)."""

from __future__ import annotations

import errno
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from megatron_ext.megatron_adapter.training.checkpoint_write import SAVE_ERRORS, cause_of, describe


def test_errno_inside_a_wrapped_error_is_named(tmp_path: Path) -> None:
    try:
        try:
            raise OSError(errno.EIO, "Input/output error")
        except OSError as inner:
            raise RuntimeError("Worker failure") from inner
    except RuntimeError as err:
        assert cause_of(err, tmp_path) == "Input/output error (EIO)"


def test_errno_of_another_rank_in_torch_checkpoint_exception(tmp_path: Path) -> None:
    err = CheckpointException("write", {2: (PermissionError(errno.EACCES, "denied"), None)})
    assert isinstance(err, SAVE_ERRORS) and not isinstance(err, Exception)  # BaseException
    assert cause_of(err, tmp_path) == "Permission denied (EACCES)"


def test_no_errno_and_room_left_is_the_first_line(tmp_path: Path) -> None:
    err = RuntimeError("Worker failure: unexpected pos 704 vs 598\nmore")
    assert cause_of(err, tmp_path) == "RuntimeError: Worker failure: unexpected pos 704 vs 598"


def test_line_names_directory_bytes_and_the_checkpoint_that_resumes(tmp_path: Path) -> None:
    tmp = tmp_path / "iter_0000008.tmp"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "sub" / "a.distcp").write_bytes(b"x" * 10)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    (tmp_path / "iter_0000004").mkdir()
    line = describe(OSError(errno.ENOSPC, "full"), tmp_path, tmp, 8)
    assert line == (f"could not save iteration 8 to {tmp}: No space left on device (ENOSPC), "
                    "after 10 bytes were written; latest_checkpointed_iteration.txt still names "
                    f"iteration 4, which resumes with --load {tmp_path}; free space or fix the "
                    "path (--save), then resume")
