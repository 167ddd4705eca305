"""comm.InOrder: the stats callbacks' input-gradient all-reduces reach their group in
micro-batch order even when gloo completes the all-gathers out of order (several threads per
group). Out-of-order issue would pair micro-batch i on one rank with j on another and sum the
wrong tensors, so the order is checked with callers arriving in reverse."""

from __future__ import annotations

import threading

import pytest

from megatron_ext.runtime.vocab.comm import InOrder


def _run_all(gate: InOrder, steps: dict[int, object]) -> list[threading.Thread]:
    threads = [threading.Thread(target=_call, args=(gate, i, steps[i]), daemon=True)
               for i in sorted(steps, reverse=True)]  # the last index arrives first
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "InOrder deadlocked"
    return threads


def _call(gate: InOrder, i: int, step) -> None:  # type: ignore[no-untyped-def]
    try:
        gate.run(i, step)
    except RuntimeError:
        pass


def test_steps_run_in_index_order_whichever_caller_comes_first() -> None:
    order: list[int] = []
    _run_all(InOrder(), {i: (lambda i=i: order.append(i)) for i in range(6)})
    assert order == list(range(6))


def test_a_failed_step_still_hands_the_turn_on() -> None:
    order: list[int] = []

    def fail() -> None:
        order.append(0)
        raise RuntimeError("all-gather failed")

    _run_all(InOrder(), {0: fail, 1: lambda: order.append(1), 2: lambda: order.append(2)})
    assert order == [0, 1, 2]


def test_the_step_result_and_error_reach_the_caller() -> None:
    gate = InOrder()
    assert gate.run(0, lambda: "alpha") == "alpha"
    with pytest.raises(ZeroDivisionError):
        gate.run(1, lambda: 1 / 0)
    assert gate.run(2, lambda: 2) == 2
