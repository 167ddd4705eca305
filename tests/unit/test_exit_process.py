"""pretrain_gpt.py ends through console.exit_process: no abort at exit after a run that trained.

CI once saw a torchrun-launched run train, log its last iteration and then die with "terminate
called without an active exception" (SIGABRT) on one rank. The mechanism, reproduced here
without a process group: a thread that re-takes the GIL after the interpreter began finalizing
is ended by Python with pthread_exit, and when that thread is inside a torch call (a gloo worker
releasing a collective's tensors, or here a daemon thread returning from a matmul) the unwinding
crosses noexcept C++ frames and aborts the process. exit_process does Python's exit work first
(non-daemon threads, atexit handlers, flushing) and then leaves without finalizing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BUSY_THREAD = """
import sys, threading, time, torch
a = torch.randn(1500, 1500)
def work():
    while True:
        torch.mm(a, a)  # releases the GIL inside the op, takes it back on return
threading.Thread(target=work, daemon=True).start()
time.sleep(0.3)
if sys.argv[1] == "exit_process":
    from megatron_ext.megatron_adapter.training.console import exit_process
    exit_process(0)
sys.exit(0)
"""

CONTRACT = """
import atexit, sys, threading, time
from megatron_ext.megatron_adapter.training.console import exit_process
class Finalized:
    def __del__(self):
        print("finalizer ran", flush=True)
kept = Finalized()  # a module global: only interpreter finalization deletes it
atexit.register(lambda: print("atexit ran"))
def late():
    time.sleep(0.3)
    print("thread finished")
threading.Thread(target=late).start()
print("buffered line", end="")  # stdout is a pipe: block-buffered, flushed by exit_process
exit_process(3)
"""


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_a_thread_inside_torch_at_exit_aborts_a_plain_exit_but_not_exit_process() -> None:
    plain = _run(BUSY_THREAD, "sys.exit")  # the hazard exists here, so the check below means it
    assert plain.returncode != 0 and "terminate called" in plain.stderr, (plain.returncode,
                                                                         plain.stderr[-500:])
    ours = _run(BUSY_THREAD, "exit_process")
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert "terminate called" not in ours.stderr


def test_exit_process_does_pythons_exit_work_and_keeps_the_code() -> None:
    result = _run(CONTRACT)
    assert result.returncode == 3, result.stderr[-2000:]
    # the non-daemon thread is joined before the atexit handlers run, as Python's own exit does
    assert result.stdout.split("\n") == ["buffered linethread finished", "atexit ran", ""]
    assert "finalizer ran" not in result.stdout  # finalization skipped: the abort's window
