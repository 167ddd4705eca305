"""The machine as it was beside a timed run, and the model profile it implies (shared CPU cores).

A ModelProfile holds times of one rank alone and the slowdown of `concurrency` ranks computing
at once, both taken while profiling. On a CPU shared with other work both change with that
work: a parallel CPU hog barely slows one rank alone (it takes the other core) but turns 4
ranks on 2 cores into 5 processes on 2 cores, so the ranks of a training step compute ~25%
slower than the profile's sharing slowdown says. A prediction from the profile alone is then a
prediction for a different machine than the one the run was timed on, and the calibration
error swings with the load instead of measuring the cost model.

So the calibration benchmark probes the machine right before and after every timed run with the
workload the profiler measured sharing with (`megatron_adapter.profile_model.SharingProbe`: the
model's layer stack, one rank alone, then every rank at once), and predicts each run on the
profile re-expressed at the machine state those probes saw:

- solo speed: every measured time (layers, vocabulary, optimizer) scaled by the fastest alone
  step now (median over readings of each one's fastest) against the fastest while profiling
  (`ModelProfile.sharing_alone_s`, timed in the same rounds as the layer samples; 1 when the
  profile predates it): the profile keeps each shape's fastest run, so its reference is a
  fastest run too;
- sharing: `sharing_slowdown` replaced by shared_now / alone_now, medians over the readings
  as the profiler takes it, so one burst of other work during one reading does not set it.

A run's readings (`readings_around`) are the probes right before and after it and PROBE_WINDOW
more on each side, in every round.

Both come from a fixed workload that does not depend on the plan being timed, so nothing is
fitted to the runs being scored; the probe only tells the cost model which machine it is
predicting for, as the profile does at profiling time.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from megatron_ext.errors import PlanError
from megatron_ext.planner.profile.fit import LAYER_PHASES, VOCAB_PHASES
from megatron_ext.planner.profile.profiles import (
    LayerSample,
    ModelProfile,
    OptimizerSample,
    VocabSample,
)

__all__ = ["MachineState", "ProbeReading", "at_machine_state", "machine_state", "readings_around"]

_Sample = TypeVar("_Sample", LayerSample, VocabSample, OptimizerSample)

PROBE_WINDOW = 2
"""Readings on each side beyond the two that bracket a run (`readings_around`): one probe is
~1.5 s of the stack, short next to a burst of other work, so a run's state is the median of the
6 nearest (~30-60 s of the benchmark), still close enough in time to follow a load that drifts."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeReading:
    """One probe of the machine: the profiler's layer stack, alone and shared."""

    alone_s: float
    """Mean seconds per step of the stack with one rank computing and the others idle."""
    alone_min_s: float
    """The fastest of those steps."""
    shared_s: float
    """Mean seconds per step of the stack with every rank computing it at once (median over
    ranks)."""

    def __post_init__(self) -> None:
        if not (self.alone_s > 0 and self.alone_min_s > 0 and self.shared_s > 0):
            raise ValueError(f"probe times must be > 0, got {self}")
        if self.alone_min_s > self.alone_s:
            raise ValueError(f"the fastest alone step cannot exceed the mean, got {self}")


@dataclass(frozen=True, kw_only=True, slots=True)
class MachineState:
    """The machine a run was timed on, relative to the one its profile was taken on."""

    solo_factor: float
    """How much longer one rank alone computed than while profiling (1: same speed)."""
    sharing_slowdown: float
    """How much slower each rank computed with every rank computing than alone (>= 1)."""
    readings: int
    """Probe readings the state is the median of."""


def machine_state(readings: Sequence[ProbeReading], reference_alone_s: float | None
                  ) -> MachineState:
    """The state `readings` describe. Sharing slowdown as the profiler computes it: median
    shared / median alone, at least 1. Solo factor: the median over readings of each reading's
    fastest alone step, against `reference_alone_s` (the profile's `sharing_alone_s`: the
    fastest of a few steps, like the layer times it scales, and like each reading's fastest of
    its few steps; the fastest over all readings would get many more chances at a quiet moment
    than the profile had; None: 1.0, speed unknown)."""
    if not readings:
        raise ValueError("machine_state needs at least one probe reading")
    alone = statistics.median(r.alone_s for r in readings)
    shared = statistics.median(r.shared_s for r in readings)
    fastest = statistics.median(r.alone_min_s for r in readings)
    solo = 1.0 if reference_alone_s is None else fastest / reference_alone_s
    return MachineState(solo_factor=solo, sharing_slowdown=max(1.0, shared / alone),
                        readings=len(readings))


def readings_around(sequence: Sequence[Any], run: int, width: int = PROBE_WINDOW) -> list[Any]:
    """The readings of a probe sequence `probe 0, run 0, probe 1, run 1, ..., run n-1, probe n`
    that belong to run `run`: the two bracketing it and `width` more on each side, clipped at
    the ends of the sequence."""
    if not 0 <= run < len(sequence) - 1 or width < 0:
        raise ValueError(f"run {run} is not bracketed by a sequence of {len(sequence)} readings"
                         f" (width {width})")
    return list(sequence[max(0, run - width): run + 2 + width])


def at_machine_state(profile: ModelProfile, state: MachineState) -> ModelProfile:
    """`profile` as it would have been measured on the machine `state` describes: every time
    of one rank alone scaled by the solo factor, the sharing slowdown replaced."""
    if profile.concurrency < 2:
        raise PlanError(f"the model profile was taken with concurrency={profile.concurrency}: "
                        "it has no sharing to re-measure (profile with the ranks that share "
                        "the device)")
    k = state.solo_factor

    def scaled(sample: _Sample, names: tuple[str, ...]) -> _Sample:
        return dataclasses.replace(sample, **{n: getattr(sample, n) * k for n in names})

    return dataclasses.replace(
        profile, sharing_slowdown=state.sharing_slowdown,
        sharing_alone_s=None if profile.sharing_alone_s is None else profile.sharing_alone_s * k,
        layers=tuple(scaled(s, LAYER_PHASES) for s in profile.layers),
        vocab=tuple(scaled(s, VOCAB_PHASES) for s in profile.vocab),
        optimizer=tuple(scaled(s, ("step_s",)) for s in profile.optimizer))
