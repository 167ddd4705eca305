"""What pretrain_gpt.py prints: warning filters, log handlers, and errors that torchrun shows last.

Imports neither torch nor megatron (the entry point sets this up before either is imported, so
argument errors come back in well under a second).

- Warnings: megatron-core's import-time notes on a build without Transformer Engine / Apex and
  deprecations inside megatron-core and torch that a user cannot act on are filtered
  (megatron_ext/warning_filters.py, shared by every entry point; pytest.ini filters the same
  ones for the tests). Other warnings go through
  logging (`py.warnings`), so they follow the rank rule below.
- Logging: the training log (INFO) goes to stdout, so `| tee train.log` keeps it; warnings and
  errors go to stderr. Rank 0 logs; the other ranks log errors only. megatron-core's INFO lines
  (configuration dumps, every parameter name of each gradient bucket, dataset building) show only
  with Megatron-LM's `--logging-level` (or `MEGATRON_LOGGING_LEVEL`), which sets the root logger
  level on every rank as Megatron-LM's `setup_logging` does. Lines are
  `[YYYY-mm-dd HH:MM:SS] message`, the prefix of Megatron-LM's iteration line; warnings add the
  level and the logger name.
- Errors: a user error (PlanError) is one line on stderr from one rank and, on every rank that
  hit it, torchrun's error file (TORCHELASTIC_ERROR_FILE, the JSON layout of torch's
  `torch/distributed/elastic/multiprocessing/errors/error_handler.py`), so the root-cause block
  torchrun prints last shows that line instead of "To enable traceback see ...". Local rank 0
  prints it (once per node); the other local ranks that hit the same error exit 0 before it
  (`report_user_error`), so torchrun's summary lists the line once, as local rank 0's failure,
  instead of once per rank.
- Exit (`exit_process`): the process ends with `os._exit` once Python's own exit work is done,
  without the interpreter's finalization; see that function for why.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import sys
import threading
import time
from typing import NoReturn

from megatron_ext.warning_filters import install

PROG = "pretrain_gpt.py"
# How long a local rank other than 0 waits for local rank 0 to report the same error: parsing
# takes ~0.1 s alone and a few seconds on an overloaded machine; a rank 0 that did not hit the
# error never writes the file, and the rank then exits after this bound.
RANK0_WAIT_S = 20.0

# megatron-core log records that repeat at default verbosity without anything to act on.
KNOWN_LOG_NOISE = (
    re.compile(r"Unable to save \w+ indexes because path_to_cache is None"),
    # rerun_state_machine.py logs its mode at WARNING; result validation is off here (pretrain.py)
    re.compile(r"RerunStateMachine initialized in mode RerunMode\.DISABLED"),
)


def install_warning_filters(*, cpu: bool = False) -> None:
    """megatron_ext.warning_filters.install: the third-party warnings every entry filters."""
    install(cpu=cpu)


def rank_from_env() -> int:
    """Global rank as torchrun / Slurm set it; 0 for a single process."""
    return int(os.environ.get("RANK", "0"))


def logging_level(explicit: int | None) -> int | None:
    """Megatron-LM's precedence: --logging-level, then MEGATRON_LOGGING_LEVEL, else None."""
    if explicit is not None:
        return explicit
    env = os.environ.get("MEGATRON_LOGGING_LEVEL")
    return int(env) if env else None


class _Below(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


class _DropKnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in KNOWN_LOG_NOISE)


class ConsoleFormatter(logging.Formatter):
    """`[date time] message` for INFO; warnings and errors also name their level and logger."""

    def __init__(self) -> None:
        super().__init__(datefmt="%Y-%m-%d %H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        head = f"[{self.formatTime(record, self.datefmt)}]"
        if record.levelno >= logging.WARNING:
            head += f" {record.levelname} {record.name}:"
        return f"{head} {text}"


def setup_logging(*, rank: int, level: int | None) -> None:
    """Handlers for the whole process; `level` is the resolved --logging-level (or None)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    formatter = ConsoleFormatter()
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(_Below(logging.WARNING))
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(formatter)
        root.addHandler(handler)
    logging.captureWarnings(True)  # Python warnings obey the rank rule below too
    if level is not None:  # Megatron-LM: the root level on every rank, nothing else
        root.setLevel(level)
        logging.getLogger("megatron").setLevel(logging.NOTSET)
        return
    root.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    for handler in (out, err):
        handler.addFilter(_DropKnownNoise())


def report_user_error(message: str, *, rank: int | None = None) -> int:
    """One line on stderr from local rank 0 (one per node) and torchrun's error file; returns
    the exit code: 2, or 0 on another local rank whose error local rank 0 reported already.

    Under torchrun every rank that exits non-zero (or is stopped by torchrun's SIGTERM) is one
    more entry in torchrun's failure summary. So a rank other than local rank 0 waits for local
    rank 0's error file; when it shows the same line, the rank leaves a `reported` marker (its
    pid) next to its own error file and exits 0, and local rank 0 exits only once those ranks
    are gone: torchrun's summary then names local rank 0 alone, with the line. A rank whose
    error local rank 0 did not hit (or one not under torchrun) writes its own error file,
    prints the line if it is rank 0 or a local rank 0, and exits 2. Every wait is bounded by
    RANK0_WAIT_S. `rank`: the global rank (default: from the environment)."""
    rank = rank_from_env() if rank is None else rank
    line = f"{PROG}: error: {message}"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank != 0 and _local_rank0_reported(line):
        _leave_marker()
        return 0
    if rank == 0 or local_rank == 0:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    write_error_file(f"PlanError: {message}", line)
    if local_rank == 0:
        _wait_for_other_local_ranks()
    return 2


def _rank_file(local_rank: int, name: str) -> str | None:
    """`<attempt dir>/<local rank>/name` next to torchrun's error files (None without one)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return None
    attempt_dir = os.path.dirname(os.path.dirname(path))
    return os.path.join(attempt_dir, str(local_rank), name)


def _local_rank0_reported(line: str) -> bool:
    """Whether local rank 0's error file shows `line`; waits for it RANK0_WAIT_S at most."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    rank0_file = _rank_file(0, os.path.basename(path)) if path else None
    if rank0_file is None:
        return False
    deadline = time.monotonic() + RANK0_WAIT_S
    while not os.path.exists(rank0_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(20):  # written with a plain open(): allow for a partial file
        try:
            with open(rank0_file, encoding="utf-8") as fp:
                shown = json.load(fp)["message"]["extraInfo"]["py_callstack"]
            return bool(shown == line)
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.05)
    return False


def _leave_marker() -> None:
    marker = _rank_file(int(os.environ.get("LOCAL_RANK", "0")), "reported")
    if marker is None:
        return
    try:
        with open(marker + ".tmp", "w", encoding="utf-8") as fp:
            fp.write(str(os.getpid()))
        os.replace(marker + ".tmp", marker)
    except OSError:
        pass  # local rank 0 then waits RANK0_WAIT_S and exits; the line is printed already


def _wait_for_other_local_ranks() -> None:
    """Until every other local rank has left its marker and exited (RANK0_WAIT_S at most)."""
    if _rank_file(0, "reported") is None:
        return
    deadline = time.monotonic() + RANK0_WAIT_S
    for local_rank in range(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))):
        marker = _rank_file(local_rank, "reported")
        assert marker is not None
        pid = None
        while pid is None and time.monotonic() < deadline:
            try:
                with open(marker, encoding="utf-8") as fp:
                    pid = int(fp.read())
            except (OSError, ValueError):
                time.sleep(0.05)
        while pid is not None and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    """A process that has neither exited nor become a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fp:
            return fp.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        pass
    if os.path.exists("/proc/self"):  # /proc, but no /proc/<pid>: the process is gone
        return False
    try:  # no /proc (not Linux): whether the pid exists
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def write_error_file(message: str, shown: str) -> None:
    """torchrun's error file: torch's `ErrorHandler.record_exception` layout, with `shown` (what
    torchrun prints as the failure's "traceback") in place of a Python traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": shown, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as fp:
            json.dump(data, fp)
    except OSError:
        pass  # torchrun then shows its generic note; the line above is already on stderr


def record_exception(err: BaseException) -> None:
    """An unexpected exception: torch's own recorder (traceback in the error file)."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    get_error_handler().record_exception(err)


def exit_process(code: int) -> NoReturn:
    """End pretrain_gpt.py with `code`: join the threads Python would join, run the atexit
    handlers (multiprocessing's, which stop the checkpoint writer's Manager; logging's flush),
    flush stdout and stderr, then `os._exit` instead of finalizing the interpreter.

    Why: the process groups are destroyed by then (pretrain.launch), but their C++ objects live
    on while anything still references them, and the model and DDP do through the autograd
    hooks megatron-core and FSDP2 register (a cycle through C++ that Python's collector cannot
    see): gloo's worker threads outlive the groups. A worker that releases a finished
    collective's tensors after Python dropped its own handle has to take the GIL to free them;
    once finalization has begun, Python 3.11-3.13 answer that request with pthread_exit, whose
    unwinding through the worker's noexcept frames aborts the process ("terminate called
    without an active exception", SIGABRT) after a run that trained and saved. Under load the
    window between a collective's completion and its worker's release is wide enough to hit;
    leaving without finalization closes it. Only a returned exit code comes here: an exception
    keeps Python's own exit, traceback included (entry.main)."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe, or a stream closed by a handler
            pass
    os._exit(code)
