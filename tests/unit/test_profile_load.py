"""planner/profile/load.py: the machine state probed beside a timed run, and the model profile
re-expressed at it (what keeps the CPU calibration benchmark's figures from moving with a
parallel CPU hog). Expected values are closed forms of the probe readings and the profile."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from test_profiles import MODEL, cluster_profile, model_profile

from megatron_ext.errors import PlanError
from megatron_ext.plan import LayerStrategy, PlanLayout, VocabStrategy
from megatron_ext.planner.profile.cost import ProfiledCostModel, predict_iteration_s, stage_work
from megatron_ext.planner.profile.fit import LAYER_PHASES, VOCAB_PHASES
from megatron_ext.planner.profile.load import (
    MachineState,
    ProbeReading,
    at_machine_state,
    machine_state,
    readings_around,
)
from megatron_ext.planner.profile.profiles import ModelProfile
from megatron_ext.planner.training import TrainingSpec


def shared_profile(slowdown: float = 2.0, alone_s: float | None = 0.1) -> ModelProfile:
    return dataclasses.replace(model_profile(), concurrency=4, sharing_slowdown=slowdown,
                               sharing_alone_s=alone_s)


def reading(alone_s: float, shared_s: float, alone_min_s: float | None = None) -> ProbeReading:
    return ProbeReading(alone_s=alone_s, alone_min_s=alone_min_s or alone_s, shared_s=shared_s)


def test_machine_state_from_the_readings():
    """Before/after a run in two rounds; one reading caught a burst of other work (0.9 s
    shared). Sharing: median shared / median alone; solo: median of the readings' fastest
    alone steps / reference."""
    readings = [reading(a, s, m) for a, s, m in ((0.10, 0.25, 0.095), (0.11, 0.26, 0.10),
                                                 (0.12, 0.90, 0.11), (0.10, 0.24, 0.097))]
    state = machine_state(readings, reference_alone_s=0.1)
    median_alone, median_shared = (0.10 + 0.11) / 2, (0.25 + 0.26) / 2
    assert state.sharing_slowdown == pytest.approx(median_shared / median_alone)
    assert state.solo_factor == pytest.approx((0.097 + 0.10) / 2 / 0.1)
    assert state.readings == 4
    # a profile without the alone reference: solo speed unknown, taken as unchanged
    assert machine_state(readings, None).solo_factor == 1.0
    # shared faster than alone (a burst during the alone loop): never below 1, as the profiler
    assert machine_state([reading(0.3, 0.2)], 0.1).sharing_slowdown == 1.0


def test_bad_probe_input_is_refused():
    with pytest.raises(ValueError, match="at least one probe reading"):
        machine_state([], 0.1)
    with pytest.raises(ValueError, match="must be > 0"):
        reading(0.0, 0.2)
    with pytest.raises(ValueError, match="cannot exceed the mean"):
        reading(0.1, 0.2, alone_min_s=0.2)
    with pytest.raises(PlanError, match="concurrency=1: it has no sharing"):
        at_machine_state(dataclasses.replace(model_profile(), concurrency=1),
                         MachineState(solo_factor=1.0, sharing_slowdown=2.0, readings=1))


def test_profile_at_a_state_scales_solo_times_and_replaces_the_sharing():
    prof = shared_profile()
    moved = at_machine_state(prof, MachineState(solo_factor=1.3, sharing_slowdown=2.6,
                                                readings=2))
    assert moved.sharing_slowdown == 2.6 and moved.sharing_alone_s == pytest.approx(0.13)
    assert moved.concurrency == prof.concurrency and moved.model == prof.model
    kw = {"tp": 2, "sp": True, "micro_batch_size": 3, "seq_length": 48}
    for phase in LAYER_PHASES:  # the fits scale with their samples, inside the grid and out
        for b in (3, 17):
            assert moved.layer_time_s(phase, **{**kw, "micro_batch_size": b}) == pytest.approx(
                1.3 * prof.layer_time_s(phase, **{**kw, "micro_batch_size": b}), rel=1e-9)
    for phase in VOCAB_PHASES:
        assert moved.vocab_time_s(phase, tp=2, tokens=100) == pytest.approx(
            1.3 * prof.vocab_time_s(phase, tp=2, tokens=100), rel=1e-9)
    assert moved.optimizer_step_s(5e5) == pytest.approx(1.3 * prof.optimizer_step_s(5e5),
                                                        rel=1e-9)
    # the same machine as at profiling: the same profile
    same = at_machine_state(prof, MachineState(solo_factor=1.0, sharing_slowdown=2.0,
                                               readings=1))
    assert same == prof


def test_a_hog_beside_the_run_moves_the_prediction_by_the_probed_sharing():
    """4 ranks profiled on a quiet 2-core node (slowdown 2.0: 2 slots). A CPU hog beside the run
    leaves one rank alone at full speed but makes 4 ranks 5 processes on 2 cores: the probe
    reads alone 0.1 s, shared 0.25 s. With every rank computing (pp = 1) the prediction is
    slowdown x solo compute + unshared communication: 2.5/2.0 of the compute part."""
    cluster = dataclasses.replace(cluster_profile().cluster, num_nodes=1, gpus_per_node=4)
    comm = dataclasses.replace(cluster_profile(), cluster=cluster)
    training = TrainingSpec(global_batch_size=8, seq_length=64, precision="fp32")
    layout = PlanLayout(pp=1, stages=((0, 4),), layers=(LayerStrategy(tp=2, dp=2),) * 4,
                        vocab=VocabStrategy(), micro_batch_size=4)
    prof = shared_profile(slowdown=2.0, alone_s=0.1)
    quiet = ProfiledCostModel(MODEL, cluster, training, comm=comm, model_profile=prof)
    w = stage_work(quiet, layout)
    m = 2
    compute = float((m * (w.forward_compute_s + w.backward_compute_s) + w.optimizer_s)[0])
    comm_s = float((m * (w.forward_comm_s + w.backward_comm_s) + w.tail_comm_s)[0])
    assert comm_s > 0
    assert predict_iteration_s(quiet, layout) == pytest.approx(2.0 * compute + comm_s,
                                                                 rel=1e-9)
    state = machine_state([reading(0.1, 0.25)] * 2, prof.sharing_alone_s)
    assert (state.solo_factor, state.sharing_slowdown) == (pytest.approx(1.0), pytest.approx(2.5))
    hog = ProfiledCostModel(MODEL, cluster, training, comm=comm,
                            model_profile=at_machine_state(prof, state))
    assert predict_iteration_s(hog, layout) == pytest.approx(2.5 * compute + comm_s, rel=1e-9)
    # other work that also slows one rank alone by 20%: solo compute x 1.2 as well
    busy = machine_state([reading(0.12, 0.3)], prof.sharing_alone_s)
    cm = ProfiledCostModel(MODEL, cluster, training, comm=comm,
                           model_profile=at_machine_state(prof, busy))
    assert predict_iteration_s(cm, layout) == pytest.approx(2.5 * 1.2 * compute + comm_s,
                                                              rel=1e-9)


def test_sharing_alone_time_round_trips_and_is_validated(tmp_path):
    prof = shared_profile(alone_s=0.123)
    prof.save(tmp_path / "m.json")
    assert ModelProfile.load(tmp_path / "m.json") == prof
    data = json.loads((tmp_path / "m.json").read_text())
    del data["sharing_alone_s"]  # profiles written before the field: still read
    assert ModelProfile.from_dict(data).sharing_alone_s is None
    data["sharing_alone_s"] = -1.0
    with pytest.raises(PlanError, match="sharing_alone_s"):
        ModelProfile.from_dict(data)
    assert np.isfinite(prof.sharing_alone_s)


def test_a_runs_readings_are_its_brackets_and_their_neighbours():
    seq = ["p0", "p1", "p2", "p3", "p4", "p5", "p6"]  # 6 runs, probed before, between, after
    assert readings_around(seq, 3, width=0) == ["p3", "p4"]
    assert readings_around(seq, 3) == ["p1", "p2", "p3", "p4", "p5", "p6"]
    assert readings_around(seq, 0) == ["p0", "p1", "p2", "p3"]  # clipped at the start
    assert readings_around(seq, 5, width=1) == ["p4", "p5", "p6"]  # and at the end
    with pytest.raises(ValueError, match="not bracketed"):
        readings_around(seq, 6)
