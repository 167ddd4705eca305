"""1F1B iteration time when ranks share compute (CPU cores): a processor-sharing simulation.

The planner's pipeline formula (planner/cost/pipeline.py) gives every rank its own device. When
the ranks of a node share S compute slots (measured: `ModelProfile.concurrency /
sharing_slowdown`), a rank computes at its solo speed only while at most S ranks compute; with n
ranks computing at once each runs at min(1, S * nodes / n) of it. Neither "critical path at solo
speed" nor "core-seconds / slots" is the iteration time of a pipeline: its fill and drain run
few stages at once (near solo speed), its steady state runs all of them (shared). So the 1F1B
schedule is played out event by event:

- stage k (`width` ranks computing in lockstep) runs Megatron's 1F1B order: min(p-k-1, m) warm-up
  forwards, then one forward + one backward per remaining micro-batch, then the cool-down
  backwards;
- forward i of stage k starts when forward i of stage k-1 ended plus one p2p message c_k, and
  backward i when backward i of stage k+1 ended plus c_k (and the stage's previous op ended);
- an op is compute (shared, seconds of a rank alone) followed by its exposed communication
  (not shared: the cluster profile timed it with every rank busy);
- after its last backward a stage runs its exposed gradient-reduction / all-gather tail
  (communication); the gradient-norm all-reduce of clip_grad then makes every stage wait for the
  last, and all stages run their optimizer step (compute, shared) at once.

The result is exact for this model (piecewise-constant rates between events), with O(p m)
events; it is used for the calibration benchmark's plans, not inside the search's inner loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_ext.planner.cost.pipeline import one_f_one_b_order

__all__ = ["StageWork", "shared_one_f_one_b_s"]

_EPS_S = 1e-12


@dataclass(frozen=True, kw_only=True, slots=True)
class StageWork:
    """Per-stage work of one micro-batch and of the once-per-iteration tail; arrays are [p]."""

    forward_compute_s: np.ndarray
    """Forward compute of one micro-batch, seconds of a rank alone."""
    forward_comm_s: np.ndarray
    """Exposed communication inside that forward (TP, re-layout, vocabulary)."""
    backward_compute_s: np.ndarray
    """Backward (and recompute) compute of one micro-batch, seconds of a rank alone."""
    backward_comm_s: np.ndarray
    """Exposed communication inside that backward."""
    p2p_s: np.ndarray
    """One activation (or gradient) message from stage k to its neighbour."""
    tail_comm_s: np.ndarray
    """Exposed gradient reduction and ZeRO-1 all-gather after the last backward."""
    optimizer_s: np.ndarray
    """Optimizer step, seconds of a rank alone."""
    width: int
    """Ranks per stage (they compute in lockstep)."""


@dataclass(slots=True)
class _Op:
    compute_s: float
    comm_s: float
    deps: list[tuple[int, int, float]]
    """(stage, op index, delay): this op starts after those ops ended plus the delay."""


def _schedule(work: StageWork, m: int) -> list[list[_Op]]:
    """Every stage's op list in Megatron's 1F1B order, with dependencies."""
    p = len(work.forward_compute_s)
    order = [one_f_one_b_order(k, p, m) for k in range(p)]  # [("F"|"B", micro-batch)]
    where = [{op: j for j, op in enumerate(ops)} for ops in order]
    c = work.p2p_s
    stages: list[list[_Op]] = []
    for k, ops in enumerate(order):
        out = []
        for kind, i in ops:
            if kind == "F":
                deps = [(k - 1, where[k - 1][("F", i)], float(c[k - 1]))] if k > 0 else []
                out.append(_Op(float(work.forward_compute_s[k]), float(work.forward_comm_s[k]),
                               deps))
            else:
                deps = [(k + 1, where[k + 1][("B", i)], float(c[k]))] if k < p - 1 else []
                out.append(_Op(float(work.backward_compute_s[k]), float(work.backward_comm_s[k]),
                               deps))
        out.append(_Op(0.0, float(work.tail_comm_s[k]), []))
        stages.append(out)
    tails = [(k, len(stages[k]) - 1, 0.0) for k in range(p)]
    for k in range(p):  # clip_grad's norm all-reduce: every stage waits for every tail
        stages[k].append(_Op(float(work.optimizer_s[k]), 0.0, tails))
    return stages


def shared_one_f_one_b_s(work: StageWork, num_microbatches: int, slots: float) -> float:
    """Seconds per iteration of 1F1B with `slots` ranks computing at full speed at once (summed
    over nodes); see the module docstring."""
    assert slots > 0 and num_microbatches >= 1
    stages = _schedule(work, num_microbatches)
    p = len(stages)
    done: list[list[float | None]] = [[None] * len(ops) for ops in stages]
    idx = [0] * p  # next op of each stage
    phase = ["wait"] * p  # wait -> compute -> comm -> wait (next op)
    left = [0.0] * p
    free_at = [0.0] * p  # when the stage's previous op ended
    t = 0.0
    while any(i < len(ops) for i, ops in zip(idx, stages)):
        ready = [_ready_s(stages, done, idx, free_at, k) for k in range(p)]
        for k in range(p):
            if phase[k] == "wait" and ready[k] <= t + _EPS_S:
                phase[k], left[k] = "compute", stages[k][idx[k]].compute_s
        busy = [k for k in range(p) if phase[k] == "compute"]
        rate = min(1.0, slots / max(1, work.width * len(busy)))
        steps = [left[k] / rate for k in busy]
        steps += [left[k] for k in range(p) if phase[k] == "comm"]
        steps += [ready[k] - t for k in range(p) if phase[k] == "wait" and ready[k] > t]
        assert steps, "1F1B simulation stalled"  # the schedule is deadlock-free
        dt = max(0.0, min(steps))
        t += dt
        for k in range(p):
            if phase[k] == "compute":
                left[k] -= dt * rate
                if left[k] <= _EPS_S:
                    phase[k], left[k] = "comm", stages[k][idx[k]].comm_s
            elif phase[k] == "comm":
                left[k] -= dt
            if phase[k] == "comm" and left[k] <= _EPS_S:
                done[k][idx[k]] = free_at[k] = t
                idx[k] += 1
                phase[k] = "wait"
    return t


def _ready_s(stages: list[list[_Op]], done: list[list[float | None]], idx: list[int],
             free_at: list[float], k: int) -> float:
    """When stage k's next op may start (inf: an input is not produced yet)."""
    if idx[k] >= len(stages[k]):
        return float("inf")
    start = free_at[k]
    for s, j, delay in stages[k][idx[k]].deps:
        end = done[s][j]
        if end is None:
            return float("inf")
        start = max(start, end + delay)
    return start

