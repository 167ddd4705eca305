"""`run_distributed`: run a function on N gloo CPU processes and surface their results or errors.

Importable (not under tests/) so any test tier, example or tool can use it; it imports no
megatron. Robustness over a plain `mp.spawn`:

- a wall-clock `timeout_s` for the whole run (imports included), and a separate, shorter
  `collective_timeout_s` given to the gloo process group, so a hung collective raises inside the
  ranks within seconds even when slow imports need a generous `timeout_s`. On timeout or on
  the first failing rank, every child and its descendants (e.g. dist-checkpointing's spawned
  Manager) are killed;
- child exceptions come back as traceback text and raise `DistributedError` in the parent;
- per-rank return values (picklable) come back as a list indexed by rank;
- one thread per rank (`OMP_NUM_THREADS=1`, `torch.set_num_threads(1)`): CI has few cores;
- a rank that dies without reporting (segfault, `os._exit`) is an error, not a hang;
- on timeout, each live rank first dumps its Python stacks to stderr (faulthandler, SIGUSR1);
- a lost race for the free port (EADDRINUSE) is retried with a new port.

Ranks are spawned, or forked from a server that imported heavy modules once (`preload`: the
tests' conftest.py preloads torch and megatron-core).
`fn` must be a module-level function (pickled by reference, for either start method) with the
signature `fn(rank, world_size, **kwargs)`. Groups that `fn` creates do not inherit
`collective_timeout_s`: pass a timeout when creating them (megatron-core's
`initialize_model_parallel` defaults to `distributed_timeout_minutes=30`; tests should pass 1).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_ext.runtime.host_memory import keep_freed_memory_mapped

__all__ = ["DistributedError", "find_free_port", "preload", "run_distributed"]

_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_PORT_RETRIES = 3
_ERROR_GRACE_S = 1.0
"""After the first rank fails, how long to wait for the others' tracebacks before killing."""
_EXIT_GRACE_S = 5.0
"""After every rank reported success, how long they get to exit on their own."""


_PRELOAD: list[str] = []
"""Modules the ranks' fork server imports once (see `preload`); empty: every rank is spawned."""


def preload(*modules: str) -> None:
    """Start ranks from a fork server that has imported `modules` once, instead of spawning
    fresh interpreters that each import them (torch and megatron-core take seconds of CPU per
    rank). Call before the first `run_distributed`; the server lives as long as this process.
    Each run's sys.path and working directory reach its ranks, but the environment is the
    server's: that of the first run (thread caps included)."""
    _PRELOAD[:] = list(modules)


class DistributedError(RuntimeError):
    """One or more ranks failed, died, or the run timed out. The message holds every traceback."""


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(
    rank: int,
    world_size: int,
    port: int,
    collective_timeout_s: float,
    seed: int,
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    results: Any,
) -> None:
    """Child main: init gloo, seed, run `fn`, report ("ok", value) or ("error", traceback)."""
    try:
        if hasattr(signal, "SIGUSR1"):  # the parent sends it on timeout: where did we hang?
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        torch.set_num_threads(1)
        keep_freed_memory_mapped()  # CPU ranks allocate as training does (runtime/host_memory.py)
        with contextlib.suppress(RuntimeError):  # only settable before any parallel work
            torch.set_num_interop_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        try:
            torch.manual_seed(seed)  # identical reference data on every rank
            value = fn(rank, world_size, **kwargs)
        finally:
            dist.destroy_process_group()
        # Pickle here, not in the queue's feeder thread, so an unpicklable result is an error.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", traceback.format_exc()))


@contextlib.contextmanager
def _single_thread_env() -> Iterator[None]:
    """Children inherit the environment at start(): set thread caps only while starting them."""
    saved = {name: os.environ.get(name) for name in _THREAD_ENV}
    os.environ.update({name: "1" for name in _THREAD_ENV})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _kill_tree(procs: list[Any], grace_s: float) -> None:
    """Give children `grace_s` to exit, then SIGKILL each one's descendants and itself; reap."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    try:
        import psutil
    except ImportError:  # psutil is a declared dependency; degrade to direct children only
        psutil = None
    for proc in procs:
        if not proc.is_alive():
            continue
        if psutil is not None:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        child.kill()
        proc.kill()
    for proc in procs:
        proc.join(timeout=5.0)


def _dump_stacks(procs: list[Any]) -> None:
    """Ask live children to print every thread's stack to their stderr (see `_entry`)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    for proc in procs:
        if proc.is_alive():
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(0.5)


def _collect(
    procs: list[Any], results: Any, world_size: int, timeout_s: float
) -> tuple[dict[int, Any], dict[int, str]]:
    """Wait for one report per rank; after the first error, wait only `_ERROR_GRACE_S` more."""
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    while len(values) + len(errors) < world_size:
        now = time.monotonic()
        if now >= deadline:
            missing = sorted(set(range(world_size)) - set(values) - set(errors))
            why = (
                "killed after another rank failed" if errors else f"timed out after {timeout_s:g} s"
            )
            if not errors:
                _dump_stacks(procs)
            errors.update({rank: f"{why} (stacks, if any, are on stderr)" for rank in missing})
            break
        try:
            rank, status, payload = results.get(timeout=min(0.2, deadline - now))
        except queue.Empty:
            _note_silent_exits(procs, results, values, errors)
        else:
            if status == "ok":
                try:
                    values[rank] = pickle.loads(payload)
                except Exception:  # noqa: BLE001 - e.g. a class the parent cannot import
                    errors[rank] = (
                        "result not unpicklable in the parent:\n" + traceback.format_exc()
                    )
            else:
                errors[rank] = payload
        if errors:
            deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
    return values, errors


def _note_silent_exits(
    procs: list[Any], results: Any, values: dict[int, Any], errors: dict[int, str]
) -> None:
    """A rank that exited (crash, os._exit) with nothing left in the queue is an error."""
    for rank, proc in enumerate(procs):
        if proc.exitcode is None or rank in values or rank in errors:
            continue
        time.sleep(0.2)  # its report may still be on its way through the pipe
        if results.empty():
            errors[rank] = f"exited with code {proc.exitcode} without reporting"


def _run_once(
    fn: Callable[..., Any],
    world_size: int,
    timeouts_s: tuple[float, float],
    seed: int,
    kwargs: dict[str, Any],
) -> tuple[dict[int, Any], dict[int, str]]:
    timeout_s, collective_timeout_s = timeouts_s
    ctx = mp.get_context("forkserver" if _PRELOAD else "spawn")
    if _PRELOAD:
        ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    port = find_free_port()
    procs = []
    clean = False
    try:
        with _single_thread_env():
            for rank in range(world_size):
                args = (rank, world_size, port, collective_timeout_s, seed, fn, kwargs, results)
                proc = ctx.Process(target=_entry, args=args, name=f"rank{rank}")
                proc.start()
                procs.append(proc)
        values, errors = _collect(procs, results, world_size, timeout_s)
        clean = not errors
        return values, errors
    finally:
        _kill_tree(procs, grace_s=_EXIT_GRACE_S if clean else 0.0)
        results.close()


def run_distributed(
    fn: Callable[..., Any],
    *,
    world_size: int,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
    seed: int = 0,
    **kwargs: Any,
) -> list[Any]:
    """Run module-level `fn(rank, world_size, **kwargs)` on `world_size` gloo CPU processes.

    Returns `fn`'s return values as a list indexed by rank. Raises `DistributedError` (with
    every failing rank's traceback) if any rank raises, dies, or the whole run exceeds
    `timeout_s` seconds (spawn and imports included: allow for a loaded CI machine). A single
    collective that waits longer than `collective_timeout_s` raises inside its rank. All
    children are killed before this returns or raises. Each rank runs `torch.manual_seed(seed)`
    before `fn`. `timeout_s`, `collective_timeout_s` and `seed` are not forwarded to `fn`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0 or collective_timeout_s <= 0:
        raise ValueError(
            f"timeouts must be > 0, got timeout_s={timeout_s}, "
            f"collective_timeout_s={collective_timeout_s}"
        )
    timeouts_s = (timeout_s, min(collective_timeout_s, timeout_s))
    for attempt in range(_PORT_RETRIES):
        values, errors = _run_once(fn, world_size, timeouts_s, seed, kwargs)
        port_clash = any("address already in use" in e.lower() for e in errors.values())
        if not errors or not port_clash or attempt == _PORT_RETRIES - 1:
            break
    if errors:
        report = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise DistributedError(
            f"{fn.__name__} failed on rank(s) {sorted(errors)} of {world_size}:\n{report}"
        )
    return [values[rank] for rank in range(world_size)]
