"""tools/fit_gpu_constants.py (megatron_ext/calibration/host_fit.py): its fast path is the
cost model (equal to the benchmark's prediction under any host constants), and its fit recovers
the constants behind synthetic measurements (Nelder-Mead after the grids: the grid descent alone
stalls where the constants trade against each other)."""

from __future__ import annotations

import pytest

from megatron_ext.calibration.host_fit import (
    FIT_SOURCE,
    check_fast_path,
    fast_predict,
    fast_row,
    fit,
    ranking_at,
    shipped,
    sweep_members,
)
from megatron_ext.calibration.ranking import BIG_SWEEP, meets_targets
from megatron_ext.calibration.rows import build_plan
from megatron_ext.calibration.scoring import run
from megatron_ext.calibration.vtrain import vtrain_rows
from megatron_ext.planner.cost import compute as C


@pytest.fixture(scope="module")
def fitted_rows():
    rows = [r for r in vtrain_rows() if r["source"] == FIT_SOURCE][::60]  # 24 runs
    plans = [build_plan(r) for r in rows]
    base = C.ComputeProfile()
    fast = [fast_row(r, p, base) for r, p in zip(rows, plans)]
    return rows, plans, base, fast


def test_fast_path_is_the_tools_prediction(fitted_rows):
    rows, plans, base, fast = fitted_rows
    assert {tuple(f.layers) for f in fast} > {(24.0,)}  # several depths and pipelines
    for consts in (shipped(base),
                   {"host_kernel_s": 20e-6, "host_collective_step_s": 40e-6,
                    "host_overlap_power": 2.0, "host_microbatch_s": 2e-3},
                   {"host_kernel_s": 0.0, "host_collective_step_s": 0.0,
                    "host_overlap_power": 3.0, "host_microbatch_s": 0.0}):
        assert check_fast_path(rows, plans, fast, base, consts, sample=24) < 1e-9


def test_fit_recovers_the_constants_behind_synthetic_measurements(fitted_rows):
    rows, plans, base, fast = fitted_rows
    truth = {"host_kernel_s": 30e-6, "host_collective_step_s": 20e-6,
             "host_overlap_power": 2.5, "host_microbatch_s": 1e-3}
    for f in fast:
        f.measured_s = fast_predict(f, truth)
    start = shipped(base)
    got, loss = fit(fast, start, polished=True)
    assert loss < 1e-8
    # Nelder-Mead stops within xatol = 1e-3 of a unit (us, ms, power): 1e-3 relative is ample
    for name, value in truth.items():
        assert got[name] == pytest.approx(value, rel=1e-3), name


def test_ranking_grid_scores_sweeps_as_the_bench_does():
    """--ranking-grid ranks the fit rows' sweeps with bench_published's own sweep metrics: on
    the 39 layouts of the 0.2B model at global batch 8 (2, 4 and 8 GPUs merged) its Spearman
    and top-1 regret under the shipped constants equal the bench's."""
    rows = [r for r in vtrain_rows() if r["source"] == FIT_SOURCE
            and r["model_name"] == "GPT 0.2B (12 x 1024)" and r["global_batch_size"] == 8]
    base = C.ComputeProfile()
    fast = [fast_row(r, build_plan(r), base) for r in rows]
    got = ranking_at(rows, sweep_members(rows, fast), fast, shipped(base))
    out = run(rows, loso=False)
    (bench,) = [w for w in out["sweeps"] if w["layouts"] >= BIG_SWEEP]
    assert got["merged"]["sweeps"] == 1 and bench["layouts"] == len(rows) == 39
    assert got["merged"]["max_top1_regret"] == pytest.approx(bench["top1_regret"], rel=1e-9)
    assert got["merged"]["meet"] == int(meets_targets(bench))
    per_count = [w for w in out["sweeps_one_gpu_count"] if w["layouts"] >= BIG_SWEEP]
    assert got["one_gpu_count"]["sweeps"] == len(per_count) >= 2
    assert got["one_gpu_count"]["meet"] == sum(map(meets_targets, per_count))
    assert got["one_gpu_count"]["max_top1_regret"] == pytest.approx(
        max(w["top1_regret"] for w in per_count), rel=1e-9)
