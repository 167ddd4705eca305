"""Fit the GPU cost model's fixed host-side constants on measured layout sweeps, check them on
the other published runs.

    python tools/fit_gpu_constants.py [--data PATH] [--json OUT.json] [--ablate]
        [--split-hidden] [--polish] [--every N] [--outer 'gemm_half_dim=32,128 ...']
        [--ranking-grid]

The constants (megatron_ext/planner/cost/compute.py, ComputeProfile):
  host_kernel_s           host seconds per kernel of a layer pass (compute.layer_host_s counts
                          the kernels of the layer's forward, backward and recomputed forward);
  host_collective_step_s  host-side seconds per ring step of a tensor-parallel collective;
  host_overlap_power      k of the soft maximum (gpu^k + host^k)^(1/k) of a pass;
  host_microbatch_s       fixed seconds per micro-batch on every pipeline stage.

Fit set: the rows whose source starts with --fit (default: vTrain's single-node validation runs,
1,440 layouts of 8 GPT models of 0.2-1.3B on 2/4/8 A100, Megatron-DeepSpeed). Objective: least
squares on log(predicted / measured) over the fit rows, the best point of the grids (GRIDS:
block coordinate descent, kernel time and soft-maximum power searched together). --polish also
reports the optimum off the grids (Nelder-Mead from there).
Check sets: every other source (vTrain multi-node, NVIDIA's Megatron-LM runs, BLOOM), scored by
the benchmark's own prediction (calibration/scoring.py predict) with the fitted constants.

--ranking-grid scores issue 19's ranking targets (Spearman >= 0.8, top-1 regret <= 5%) on the
fit rows' sweeps of >= 8 layouts at every point of RANKING_GRID (can any choice of the host
constants rank every sweep?).
--ablate refits with each host term off (what each one is worth); --split-hidden fits on the
runs of one hidden size and scores the others; --outer tries other kernel constants
(gemm_efficiency, gemm_half_dim, attention_efficiency), refits the host terms for each and
scores the check sets with them.

Speed: every fit row is a uniform plan (one strategy on every layer, 1F1B without interleaving),
so its iteration time is the tool's prediction with the constants off (host_* = 0), with each
layer pass replaced by its host-bound time and the per-micro-batch term added to every stage;
`fast_predict` does that in numpy on evaluate's own stage sums and 1F1B (pipeline_of), and
`check_fast_path` asserts it equals scoring.predict on a sample of rows (the fast path is the
model, not an approximation of it).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

import numpy as np

from megatron_ext.calibration.ranking import (
    BIG_SWEEP,
    gpu_s_per_token,
    meets_targets,
    sweep_fields,
    sweeps,
)
from megatron_ext.calibration.rows import cluster_of, measured_iteration_s, run_settings
from megatron_ext.calibration.scoring import predict
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.cost import compute as C
from megatron_ext.planner.cost.evaluate import StageSums, pipeline_of, plan_training, stage_sums
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.space import StrategyTable

FIT_SOURCE = "vTrain single node"
HOST_FIELDS = ("host_kernel_s", "host_collective_step_s", "host_overlap_power",
               "host_microbatch_s")
GRIDS = {
    "host_kernel_s": [x * 1e-6 for x in (0, 10, 20, 30, 35, 40, 42.5, 45, 47.5, 50, 52.5, 55,
                                         57.5, 60, 65, 70, 80)],
    "host_collective_step_s": [x * 1e-6 for x in (0, 2.5, 5, 7.5, 10, 12.5, 15, 20, 25, 30, 40,
                                                  60, 100)],
    "host_overlap_power": [1.5, 2.0, 2.25, 2.5, 2.75, 3.0, 3.25, 3.5, 4.0, 5.0, 6.0],
    "host_microbatch_s": [x * 1e-3 for x in (0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 4)],
}


def off_profile(base: C.ComputeProfile) -> C.ComputeProfile:
    return dataclasses.replace(base, host_kernel_s=0.0, host_collective_step_s=0.0,
                               host_microbatch_s=0.0)


@dataclasses.dataclass
class FastRow:
    """The parts of one uniform row's prediction that do not depend on the host constants."""

    measured_s: float
    cm: CostModel  # the row's cost model with the host constants off
    sums: StageSums  # its stage sums (evaluate's), host constants off
    layers: np.ndarray  # [pp] layers per stage
    gpu_f: float  # one layer's forward (compute + exposed comm), host off
    gpu_b: float  # its backward without recomputation
    gpu_rc: float  # its recomputed forward (full recompute)
    kern_f: float  # host_kernel_s multiplier of the forward host time
    kern_b: float
    step: float  # host_collective_step_s multiplier (forward = backward)


def fast_row(row: dict[str, Any], plan: ParallelPlan, compute: C.ComputeProfile) -> FastRow:
    assert len(set(plan.layers)) == 1 and plan.virtual_stages == 1, row["id"]
    s = plan.layers[0]
    assert s.recompute == "full", row["id"]
    training = plan_training(plan, **run_settings(row))
    cm = CostModel(plan.model, cluster_of(row), training, compute=off_profile(compute))
    sums = stage_sums(cm, plan.layout)
    table = StrategyTable.of([s])
    lc = cm.layer_costs(table, plan.micro_batch_size)
    unit_k = C.HostConstants(kernel_s=1.0)
    unit_s = C.HostConstants(collective_step_s=1.0)
    fused = cm.fused_softmax(table, plan.micro_batch_size / table.dp)
    kf, kb, _ = C.layer_host_s(plan.model, unit_k, tp=table.tp, fused_softmax=fused,
                               flash_attention=training.flash_attention, dropout=training.dropout)
    sf, sb, _ = C.layer_host_s(plan.model, unit_s, tp=table.tp, fused_softmax=fused,
                               flash_attention=training.flash_attention, dropout=training.dropout)
    assert float(sf[0]) == float(sb[0])
    rc = float(lc.recompute_s[0])
    return FastRow(
        measured_s=measured_iteration_s(row)[0], cm=cm, sums=sums,
        layers=np.array([e - b for b, e in plan.stages], dtype=float),
        gpu_f=float(lc.forward_s[0]), gpu_b=float(lc.backward_s[0]) - rc, gpu_rc=rc,
        kern_f=float(kf[0]), kern_b=float(kb[0]), step=float(sf[0]))


def fast_predict(r: FastRow, c: dict[str, float]) -> float:
    """scoring.predict of the row with the host constants `c` (see module doc): the stage sums
    with each layer pass replaced by its host-bound time, through evaluate's 1F1B
    (pipeline_of)."""
    k = c["host_overlap_power"]
    hf = r.kern_f * c["host_kernel_s"] + r.step * c["host_collective_step_s"]
    hb = r.kern_b * c["host_kernel_s"] + r.step * c["host_collective_step_s"]
    f1 = float(C.host_bound_s(r.gpu_f, hf, k))
    b1 = float(C.host_bound_s(r.gpu_b, hb, k)) + float(C.host_bound_s(r.gpu_rc, hf, k))
    arr = r.sums.arr
    f = arr["f"] + r.layers * (f1 - r.gpu_f) + c["host_microbatch_s"]
    b = arr["b"] + r.layers * (b1 - r.gpu_b - r.gpu_rc)
    sums = dataclasses.replace(r.sums, arr={**arr, "f": f, "b": b})
    return float(pipeline_of(r.cm, sums).iteration_s)


def shipped(profile: C.ComputeProfile) -> dict[str, float]:
    """The A100 presets' host constants as ComputeProfile fields."""
    host = profile.host_for(cluster_of({"gpu_type": "A100 80GB", "num_gpus": 8,
                                           "gpus_per_node": 8}))
    return {"host_kernel_s": host.kernel_s, "host_collective_step_s": host.collective_step_s,
            "host_overlap_power": profile.host_overlap_power,
            "host_microbatch_s": host.microbatch_s}


def profile_with(base: C.ComputeProfile, c: dict[str, float]) -> C.ComputeProfile:
    return dataclasses.replace(base, **c)


def check_fast_path(rows: list[dict[str, Any]], plans: list[ParallelPlan], fast: list[FastRow],
                    base: C.ComputeProfile, c: dict[str, float], sample: int = 12) -> float:
    """Largest relative difference between fast_predict and scoring.predict."""
    step = max(1, len(rows) // sample)
    worst = 0.0
    for i in range(0, len(rows), step):
        slow = predict(rows[i], plans[i], profile_with(base, c))["predicted_s"]
        worst = max(worst, abs(fast_predict(fast[i], c) / slow - 1))
    return worst


def loss(fast: list[FastRow], c: dict[str, float]) -> float:
    return statistics.fmean(math.log(fast_predict(r, c) / r.measured_s) ** 2 for r in fast)


JOINT = ("host_kernel_s", "host_overlap_power")
"""Searched together on their full grid: the floor's height and the softness of the maximum
trade against each other (one coordinate at a time stalls in their valley)."""


def fit(fast: list[FastRow], start: dict[str, float], rounds: int = 6, *, polished: bool = False
        ) -> tuple[dict[str, float], float]:
    """Block coordinate descent over GRIDS: the JOINT pair on its full product grid, then each
    other constant in turn, the rest held; until a round moves nothing. `polished`: then
    Nelder-Mead from there (`polish`)."""
    best = dict(start)
    best_loss = loss(fast, best)
    others = [n for n in HOST_FIELDS if n not in JOINT]
    for _ in range(rounds):
        moved = False
        blocks: list[list[tuple[float, ...]]] = [
            [(a, b) for a in GRIDS[JOINT[0]] for b in GRIDS[JOINT[1]]]]
        names = [JOINT] + [(n,) for n in others]
        blocks += [[(v,) for v in GRIDS[n]] for n in others]
        for block_names, values in zip(names, blocks):
            for value in values:
                trial = {**best, **dict(zip(block_names, value))}
                if trial == best:
                    continue
                score = loss(fast, trial)
                if score < best_loss - 1e-12:
                    best, best_loss, moved = trial, score, True
        if not moved:
            break
    return polish(fast, best, best_loss) if polished else (best, best_loss)


SCALE = {"host_kernel_s": 1e-6, "host_collective_step_s": 1e-6, "host_overlap_power": 1.0,
         "host_microbatch_s": 1e-3}
"""Units the continuous search moves in (us, us, 1, ms)."""


def polish(fast: list[FastRow], start: dict[str, float], start_loss: float
           ) -> tuple[dict[str, float], float]:
    """Nelder-Mead from the grid's best (the grids are coarse and the constants trade against
    each other); times are kept >= 0 and the power >= 1. Returns the better of the two."""
    from scipy.optimize import minimize

    names = [n for n in HOST_FIELDS if len(GRIDS[n]) > 1]  # a constant pinned (--ablate) stays

    def unpack(x: np.ndarray) -> dict[str, float]:
        out = dict(start)
        for n, v in zip(names, x):
            out[n] = max(1.0, float(v)) if n == "host_overlap_power" else max(0.0, float(v))
            out[n] *= SCALE[n]
        return out

    res = minimize(lambda x: loss(fast, unpack(x)), [start[n] / SCALE[n] for n in names],
                   method="Nelder-Mead", options={"xatol": 1e-3, "fatol": 1e-10, "maxiter": 3000})
    found = unpack(res.x)
    score = loss(fast, found)
    return (found, score) if score < start_loss else (start, start_loss)

RANKING_GRID = {
    "host_kernel_s": [x * 1e-6 for x in (45, 52.5, 60)],
    "host_collective_step_s": [x * 1e-6 for x in (0, 5, 20)],
    "host_overlap_power": [2.5, 3.25, 4.5],
    "host_microbatch_s": [x * 1e-3 for x in (0.25, 1)],
}
"""Around the shipped constants, wider than their fitted spread (--ranking-grid)."""


def sweep_members(rows: list[dict[str, Any]], fast: list[FastRow]) -> list[dict[str, Any]]:
    """The benchmark's sweep fields of the fit rows (the prediction filled in later)."""
    return [sweep_fields(row, measured_s=r.measured_s, num_microbatches=r.sums.num_microbatches,
                            pp=len(r.layers), num_layers=int(row["num_layers"]))
            for row, r in zip(rows, fast)]


def ranking_at(rows: list[dict[str, Any]], members: list[dict[str, Any]], fast: list[FastRow],
               c: dict[str, float]) -> dict[str, Any]:
    """Median |error| of the fit rows and the sweeps of >= BIG_SWEEP layouts meeting both
    ranking targets (GPU counts merged, and at one GPU count) under host constants `c`."""
    pred = [fast_predict(r, c) for r in fast]
    scored = [{**m, "predicted_gpu_s_per_token": p * gpu_s_per_token(row)}
              for m, p, row in zip(members, pred, rows)]
    out: dict[str, Any] = {"median_abs_error": statistics.median(
        abs(p / r.measured_s - 1) for p, r in zip(pred, fast))}
    for name, per_count in (("merged", False), ("one_gpu_count", True)):
        big = [w for w in sweeps(scored, per_gpu_count=per_count)
               if w["layouts"] >= BIG_SWEEP]
        out[name] = {"sweeps": len(big), "meet": sum(map(meets_targets, big)),
                     "max_top1_regret": max(w["top1_regret"] for w in big)}
    return out


def ranking_grid(rows: list[dict[str, Any]], fast: list[FastRow], start: dict[str, float]
                 ) -> list[dict[str, Any]]:
    members = sweep_members(rows, fast)
    settings = [{**start, **q} for q in combinations(RANKING_GRID)]
    if start not in settings:
        settings.insert(0, dict(start))
    return [{"constants": c, "shipped": c == start, **ranking_at(rows, members, fast, c)}
            for c in settings]


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    errs = [abs(r["ratio"] - 1) for r in results]
    return {"rows": len(results), "median_abs_error": statistics.median(errs),
            "mean_abs_error": statistics.fmean(errs),
            "median_ratio": statistics.median(r["ratio"] for r in results)}


def check(rows: list[dict[str, Any]], plans: list[ParallelPlan], profile: C.ComputeProfile
          ) -> dict[str, Any]:
    """The benchmark's prediction of `rows` under `profile`: median |error| by source group."""
    out: dict[str, list[float]] = {}
    for row, plan in zip(rows, plans):
        ratio = predict(row, plan, profile)["predicted_s"] / measured_iteration_s(row)[0]
        out.setdefault(check_group(row), []).append(abs(ratio - 1))
    return {k: {"rows": len(v), "median_abs_error": statistics.median(v)}
            for k, v in sorted(out.items())}


def check_group(row: dict[str, Any]) -> str:
    src = str(row["source"])
    if src.startswith("vTrain"):
        return "vTrain multi-node"
    if row.get("cluster_label") == "jean-zay-a100-80g":
        return "BLOOM (Jean Zay)"
    return "NVIDIA / MosaicML"


def combinations(grid: dict[str, list[float]]) -> list[dict[str, float]]:
    """Every combination of the grid's values, one dict each."""
    combos: list[dict[str, float]] = [{}]
    for name, values in grid.items():
        combos = [{**c, name: v} for c in combos for v in values]
    return combos


def parse_outer(text: str) -> list[dict[str, float]]:
    """'gemm_efficiency=0.72,0.76 gemm_half_dim=64,128' -> every combination."""
    grid = {}
    for part in text.split():
        name, values = part.split("=")
        grid[name] = [float(v) for v in values.split(",")]
    return combinations(grid)
