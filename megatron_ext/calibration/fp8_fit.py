"""The FP8 rows' held-out check: the FP8 GEMM efficiency refitted on all FP8 sources but one,
the held-out source scored with it, and the 90% interval each held-out run would get.

The FP8 rows (tools/data/published_runs_fp8.json: H100, GB200 and GB300 runs) are priced with
one FP8 constant the A100 rows cannot fit, ComputeProfile.fp8_gemm_efficiency (the share of the
FP8 peak a large FP8 GEMM reaches; planner/cost/fp8.py). As the A100 refit does for
gemm_efficiency (residuals.leave_one_source_out), it is refitted over FP8_EFFICIENCY_GRID on
every FP8 source but one, minimising the mean of the sources' median |error| (fit_score), and
the held-out source is scored with it.

Intervals: the table a user's plan gets is the shipped A100 residual table
(planner/cost/residuals_a100.json). A held-out FP8 run is scored against that table's runs plus
the held-out residuals of the other FP8 sources (build_table over both), so its interval is
what the package would give it had its source not been measured.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from typing import Any

from megatron_ext.calibration.residuals import fit_score
from megatron_ext.calibration.rows import build_plan, cluster_label, measured_iteration_s
from megatron_ext.calibration.scoring import predict
from megatron_ext.planner.cost import interval as iv
from megatron_ext.planner.cost.compute import ComputeProfile

FP8_EFFICIENCY_GRID = tuple(round(0.40 + 0.05 * i, 2) for i in range(9))
"""0.40-0.80 of the FP8 peak (fp8.md section 4 puts large FP8 GEMMs near 0.6-0.7)."""


def is_fp8(row: dict[str, Any]) -> bool:
    return bool(row.get("fp8_format"))


def shipped_runs() -> list[tuple[dict[str, str], float, str]]:
    """(features, log residual, source) of the runs behind the shipped interval table."""
    data = json.loads(iv.TABLE_PATH.read_text(encoding="utf-8"))
    names = data["features"]
    return [(dict(zip(names, feats)), float(res), str(src))
            for _, src, feats, _, res in data["runs"]]


def fp8_leave_one_source_out(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per FP8 source: the grid value fitted on the other FP8 sources, the held-out median
    |error| and 90% interval coverage; per run the held-out prediction. {} with fewer than two
    FP8 sources."""
    fp8 = [r for r in rows if is_fp8(r)]
    sources = sorted({r["source"] for r in fp8})
    if len(sources) < 2:
        return {}
    plans = [build_plan(r) for r in fp8]
    meas = [measured_iteration_s(r)[0] for r in fp8]
    src = [r["source"] for r in fp8]
    base = ComputeProfile()
    grid = [[predict(r, p, dataclasses.replace(base, fp8_gemm_efficiency=e))["predicted_s"]
             for r, p in zip(fp8, plans)] for e in FP8_EFFICIENCY_GRID]
    feats = [iv.plan_features(num_gpus=r["num_gpus"], micro_batch_size=iv.replica_micro_batch(p),
                              pp=p.pp, precision=p.precision, cluster=cluster_label(r))
             for r, p in zip(fp8, plans)]
    held = [0.0] * len(fp8)
    chosen: dict[str, float] = {}
    for s in sources:
        train = [i for i in range(len(fp8)) if src[i] != s]
        k = min(range(len(grid)), key=lambda j: fit_score(grid[j], meas, src, train))
        chosen[s] = FP8_EFFICIENCY_GRID[k]
        for i in range(len(fp8)):
            if src[i] == s:
                held[i] = grid[k][i]
    resid = [math.log(meas[i] / held[i]) for i in range(len(fp8))]
    a100 = shipped_runs()
    out_rows, per_source = [], []
    for s in sources:
        table = iv.build_table(a100 + [(feats[i], resid[i], src[i])
                                       for i in range(len(fp8)) if src[i] != s])
        errors, hits = [], []
        for i in (i for i in range(len(fp8)) if src[i] == s):
            lo, hi, unseen = iv.log_bounds(table, feats[i])
            hit = lo <= resid[i] <= hi
            errors.append(abs(held[i] / meas[i] - 1))
            hits.append(hit)
            out_rows.append({"id": fp8[i]["id"], "source": s, "measured_s": meas[i],
                             "loso_predicted_s": held[i], "ratio": held[i] / meas[i],
                             "interval_low_s": held[i] * math.exp(lo),
                             "interval_high_s": held[i] * math.exp(hi),
                             "inside": hit, "unseen": unseen})
        per_source.append({"source": s, "rows": len(errors),
                           "fp8_gemm_efficiency": chosen[s],
                           "median_abs_error": statistics.median(errors),
                           "interval_coverage": statistics.fmean(hits)})
    errors = [abs(r["ratio"] - 1) for r in out_rows]
    return {"grid": list(FP8_EFFICIENCY_GRID), "sources": per_source, "rows": out_rows,
            "median_abs_error": statistics.median(errors),
            "interval_coverage": statistics.fmean(r["inside"] for r in out_rows)}


def print_fp8_report(out: dict[str, Any]) -> None:
    """The FP8 held-out table (what tools/bench_published.py prints after the main report)."""
    if not out:
        return
    print()
    print(f"{'FP8 run (held out: fp8_gemm_efficiency fitted on the other FP8 sources)':44} "
          f"{'meas s':>8} {'held s':>8} {'ratio':>6} {'90% interval s':>17} {'in':>3}")
    for r in out["rows"]:
        print(f"{r['id']:44} {r['measured_s']:8.3f} {r['loso_predicted_s']:8.3f} "
              f"{r['ratio']:6.3f} {r['interval_low_s']:8.3f}-{r['interval_high_s']:<8.3f} "
              f"{'yes' if r['inside'] else 'NO':>3}")
    print(f"{'held-out FP8 source':58} {'rows':>4} {'eff8':>5} {'|error|':>7} {'in 90%':>6}")
    for e in out["sources"]:
        print(f"{e['source'][:58]:58} {e['rows']:4d} {e['fp8_gemm_efficiency']:5.2f} "
              f"{100 * e['median_abs_error']:6.1f}% {100 * e['interval_coverage']:5.0f}%")
    print(f"FP8 rows held out: median |error| {100 * out['median_abs_error']:.1f}%, 90% interval "
          f"coverage {100 * out['interval_coverage']:.0f}%")
