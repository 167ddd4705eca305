"""--exit-signal-handler's handler on a one-rank gloo group: SIGTERM and SIGINT (Ctrl-C) only set
a flag, `received()` reports it (after the all-reduce every rank runs), `release()` restores the
previous handlers. tests/dist/test_checkpoint_ops.py sends SIGTERM to a 4-rank training run."""

from __future__ import annotations

import argparse
import os
import signal
import socket

import pytest
import torch
import torch.distributed as dist

from megatron_ext.megatron_adapter.training.preemption import ExitSignalHandler
from megatron_ext.megatron_adapter.training.run_config import _exit_signals


@pytest.fixture
def world() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_sets_a_flag_and_release_restores(world: None, sig: signal.Signals) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    handler = ExitSignalHandler(_exit_signals(argparse.Namespace(
        exit_signal_handler=True, exit_signal=signal.SIGTERM)), torch.device("cpu")).install()
    try:
        assert handler.received() is None
        os.kill(os.getpid(), sig)  # the process survives: the handler only records it
        os.kill(os.getpid(), sig)  # a repeated signal (impatient Ctrl-C) too
        assert handler.received() == sig
    finally:
        handler.release()
    assert {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} == before


def test_exit_signal_flag_picks_the_signal() -> None:
    def signals(**flags: object) -> tuple[int, ...]:
        return _exit_signals(argparse.Namespace(**flags))

    assert signals(exit_signal_handler=False, exit_signal=signal.SIGTERM) == ()
    assert signals(exit_signal_handler=True, exit_signal=signal.SIGUSR1) == (signal.SIGUSR1,
                                                                             signal.SIGINT)
    assert signals(exit_signal_handler=True, exit_signal=signal.SIGINT) == (signal.SIGINT,)
