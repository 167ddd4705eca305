"""--exit-signal-handler: save at the end of the current step and exit 0 (preemption, Ctrl-C).

Megatron-LM's `DistributedSignalHandler` (megatron/training/dist_signal_handler.py) sets a flag
when `--exit-signal` arrives; after every step `train` asks whether any rank got it (one
collective, so all ranks stop after the same step), saves and exits 0. As there, the signal only
sets a flag: the step in flight finishes, nothing is interrupted mid-collective. SIGINT is caught
too (Ctrl-C reaches every process of the terminal's process group), and a repeated signal while
saving is ignored rather than killing the save.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist


class ExitSignalHandler:
    """Catches `signals` from `install()` to `release()`; `received()` is collective."""

    def __init__(self, signals: tuple[int, ...], device: torch.device) -> None:
        self.signals = signals
        self.device = device
        """Where the flag is reduced: the model's device (gloo: CPU, NCCL: the GPU)."""
        self._received = 0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._received = max(self._received, signum)

    def install(self) -> ExitSignalHandler:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def release(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def received(self) -> signal.Signals | None:
        """The signal any rank received (the highest number if several), else None. Every
        rank must call it at the same point (an all-reduce over the world)."""
        flag = torch.tensor([self._received], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        return signal.Signals(value) if value else None


def install_exit_signal_handler(signals: tuple[int, ...],
                                backend: Any) -> ExitSignalHandler | None:
    """Catch `signals` (the run's `exit_signals`) from now on; None when there are none."""
    if not signals:
        return None
    device = next(backend.model[0].parameters()).device
    return ExitSignalHandler(signals, device).install()

