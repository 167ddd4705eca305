"""The shared-compute 1F1B simulation (megatron_ext/planner/profile/pipeline.py) against closed
forms."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.planner.cost.pipeline import one_f_one_b
from megatron_ext.planner.profile.pipeline import StageWork, shared_one_f_one_b_s


def work(f, b, *, c=0.0, width=1, f_comm=0.0, b_comm=0.0, tail=0.0, opt=0.0) -> StageWork:
    z = np.zeros(len(f))
    return StageWork(forward_compute_s=np.asarray(f, float), forward_comm_s=z + f_comm,
                     backward_compute_s=np.asarray(b, float), backward_comm_s=z + b_comm,
                     p2p_s=z + c, tail_comm_s=z + tail, optimizer_s=z + opt, width=width)


@pytest.mark.parametrize("f, b, m", [([1.0] * 4, [2.0] * 4, 4), ([1, 2, 1, 3], [2, 3, 2, 5], 6),
                                     ([0.5, 1.5], [1.0, 4.0], 1), ([2.0], [3.0], 5)])
def test_no_sharing_is_the_planners_1f1b(f, b, m):
    """Enough slots for every rank, no communication: the planner's closed form (which is exact
    for 1F1B without p2p time, uneven stages included)."""
    f, b = np.asarray(f, float), np.asarray(b, float)
    z = np.zeros_like(f)
    ref = float(one_f_one_b(f, b, z, z, z, z, m).iteration_s)
    assert shared_one_f_one_b_s(work(f, b), m, slots=len(f)) == pytest.approx(ref, rel=1e-12)


def test_all_ranks_busy_share_the_slots():
    """pp = 1, 4 ranks on 2 slots: compute takes 4/2 times as long; communication and the
    gradient tail do not share; the optimizer (compute) does."""
    w = work([1.0], [2.0], width=4, f_comm=0.25, b_comm=0.5, tail=0.3, opt=0.1)
    m = 3
    expected = m * (3.0 * 2 + 0.75) + 0.3 + 0.1 * 2
    assert shared_one_f_one_b_s(w, m, slots=2.0) == pytest.approx(expected, rel=1e-12)


def test_one_micro_batch_runs_stages_alone():
    """m = 1: one stage computes at a time, at its solo speed, whatever the slots; p2p messages
    sit on the path twice per boundary."""
    f, b, c = [1.0, 2.0, 1.5], [2.0, 3.0, 2.5], 0.1
    assert shared_one_f_one_b_s(work(f, b, c=c), 1, slots=1.0) == pytest.approx(
        sum(f) + sum(b) + 2 * 2 * c, rel=1e-12)


def test_pipeline_on_shared_slots_is_above_both_bounds():
    """4 stages on 1.6 slots: the steady state is shared, fill and drain are not, so the time is
    above both the solo critical path and core-seconds / slots, and below their sum."""
    f, b, m, slots = [1.0] * 4, [2.0] * 4, 4, 1.6
    path = (m + 4 - 1) * 3.0
    throughput = 4 * m * 3.0 / slots
    got = shared_one_f_one_b_s(work(f, b), m, slots=slots)
    assert max(path, throughput) < got < path + throughput
    # more slots never slow it down, and with slots for all it is the critical path
    assert shared_one_f_one_b_s(work(f, b), m, slots=3.0) < got
    assert shared_one_f_one_b_s(work(f, b), m, slots=4.0) == pytest.approx(path, rel=1e-12)
