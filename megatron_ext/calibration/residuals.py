"""The held-out calibration: gemm_efficiency refitted on all sources but one, the held-out
source scored with it, and the interval's residual table (planner/cost/residuals_a100.json) of
those held-out errors."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from megatron_ext.calibration.lucie import LUCIE_SOURCES
from megatron_ext.calibration.ranking import sweeps
from megatron_ext.calibration.vtrain import VTRAIN_SOURCES
from megatron_ext.planner.cost import interval as iv

GEMM_EFFICIENCY_GRID = tuple(round(0.64 + 0.02 * i, 2) for i in range(9))
"""Leave-one-source-out refits ComputeProfile.gemm_efficiency (the constant issue 14 calibrated
on these runs; 0.72 shipped) over this grid on all sources but one and scores that one."""


def fit_score(pred: list[float], meas: list[float], sources: list[str], train: list[int]
              ) -> float:
    """What the refit minimises: the mean over the training sources of each source's median
    |error|, so every source counts once (1,440 vTrain single-node rows do not outvote the nine
    sources of a few rows each; weighting rows alike, every other held-out source got the
    grid's lowest value from them)."""
    per: dict[str, list[float]] = {}
    for i in train:
        per.setdefault(sources[i], []).append(abs(pred[i] / meas[i] - 1))
    return statistics.fmean(statistics.median(v) for v in per.values())


def calibrates(result: dict[str, Any]) -> bool:
    """Whether a run may set a constant or an interval: not where its source's settings are
    known to be incomplete (`not_for_calibration` on the row says why); such runs are still
    predicted, held out and scored like every other."""
    return not result.get("not_for_calibration")


def leave_one_source_out(results: list[dict[str, Any]], grid_pred: list[list[float]]
                         ) -> dict[str, Any]:
    """Refit gemm_efficiency on all sources but one (lowest fit_score over the grid), score
    the held-out source with it; then the residual table of the intervals built without each
    source, and the share of that source's measured times inside its 90% intervals. Runs that
    do not calibrate (`calibrates`) are held out and scored but train nothing."""
    sources = sorted({r["source"] for r in results})
    meas = [r["measured_s"] for r in results]
    row_source = [r["source"] for r in results]
    per_source, loso_pred = [], [0.0] * len(results)
    for src in sources:
        train = [i for i, r in enumerate(results) if r["source"] != src and calibrates(r)]
        test = [i for i, r in enumerate(results) if r["source"] == src]
        if not train:
            return {}
        scores = [fit_score(g, meas, row_source, train) for g in grid_pred]
        k = min(range(len(scores)), key=lambda j: scores[j])
        for i in test:
            loso_pred[i] = grid_pred[k][i]
            results[i]["loso_gemm_efficiency"] = GEMM_EFFICIENCY_GRID[k]
        per_source.append({"source": src, "rows": len(test),
                           "gemm_efficiency": GEMM_EFFICIENCY_GRID[k],
                           "median_abs_error": statistics.median(
                               abs(loso_pred[i] / meas[i] - 1) for i in test)})
    residuals = [(r["features"], math.log(meas[i] / loso_pred[i]), r["source"])
                 for i, r in enumerate(results)]
    inside, widths = [0] * len(results), [0.0] * len(results)
    for entry in per_source:
        src = entry["source"]
        held_in = [residuals[i] for i, r in enumerate(results)
                   if r["source"] != src and calibrates(r)]
        table = iv.build_table(held_in)
        hits = []
        for i, r in enumerate(results):
            if r["source"] != src:
                continue
            lo, hi, _ = iv.log_bounds(table, r["features"])
            inside[i] = int(lo <= residuals[i][1] <= hi)
            widths[i] = math.exp(hi) - math.exp(lo)
            hits.append(inside[i])
        entry["interval_coverage"] = statistics.fmean(hits)
    for i, r in enumerate(results):
        r["loso_predicted_s"] = loso_pred[i]
        r["loso_log_residual"] = residuals[i][1]
        r["loso_interval_hit"] = bool(inside[i])
    errors = [abs(loso_pred[i] / meas[i] - 1) for i in range(len(results))]
    held = [{**r, "predicted_gpu_s_per_token": r["loso_predicted_s"]
             * r["measured_gpu_s_per_token"] / r["measured_s"]} for r in results]
    groups = {}
    for name, keep in (("vTrain", lambda r: r["source"] in VTRAIN_SOURCES),
                       ("Lucie-7B", lambda r: r["source"] in LUCIE_SOURCES),
                       ("papers and READMEs",
                        lambda r: r["source"] not in VTRAIN_SOURCES | LUCIE_SOURCES)):
        idx = [i for i, r in enumerate(results) if keep(r)]
        if idx:
            groups[name] = {"rows": len(idx),
                            "median_abs_error": statistics.median(errors[i] for i in idx),
                            "interval_coverage": statistics.fmean(inside[i] for i in idx)}
    return {
        "sources": per_source,
        "by_group": groups,
        "median_abs_error": statistics.median(errors),
        "mean_abs_error": statistics.fmean(errors),
        "interval_coverage": statistics.fmean(inside),
        "interval_median_width": statistics.median(widths),
        "sweeps": sweeps(held),
        "sweeps_one_gpu_count": sweeps(held, per_gpu_count=True),
    }


def residual_file(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The interval's residual table (planner/cost/interval.py) with the runs it came from: per
    run its id, source, features (in the order of `features`), the gemm_efficiency fitted
    without its source and log(measured / predicted) with it. Runs that do not calibrate
    (`calibrates`) are left out."""
    results = [r for r in results if calibrates(r)]
    return {
        "about": "log(measured / predicted) of published A100 runs, each predicted with "
                 "gemm_efficiency fitted on the other sources (leave-one-source-out), grouped "
                 "by feature; read by megatron_ext/planner/cost/interval.py. Written by "
                 "`python tools/bench_published.py --write-residuals "
                 "megatron_ext/planner/cost/residuals_a100.json`; do not edit by hand.",
        "features": list(iv.FEATURES),
        "quantiles": [iv.LOW_Q, iv.HIGH_Q],
        "run_fields": ["id", "source", "features", "gemm_efficiency", "log_residual"],
        "runs": [[r["id"], r["source"], [r["features"][f] for f in iv.FEATURES],
                  r["loso_gemm_efficiency"], round(r["loso_log_residual"], 6)] for r in results],
        "table": iv.build_table([(r["features"], r["loso_log_residual"], r["source"])
                                 for r in results]),
    }


def residual_text(data: dict[str, Any]) -> str:
    """The residual file as JSON with one run per line (1,630 runs: a third of the indented
    size, and the package reads it whole)."""
    head = json.dumps({k: v for k, v in data.items() if k not in ("runs", "table")}, indent=1)
    runs = ",\n".join("  " + json.dumps(r) for r in data["runs"])
    return (head[:-2] + ',\n "runs": [\n' + runs + '\n ],\n "table": '
            + json.dumps(data["table"], indent=1).replace("\n", "\n ") + "\n}\n")
