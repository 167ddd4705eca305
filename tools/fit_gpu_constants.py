"""Fit the GPU cost model's fixed host-side constants on measured layout sweeps, check them on
the other published runs.

    python tools/fit_gpu_constants.py [--data PATH] [--json OUT.json] [--ablate]
        [--split-hidden] [--polish] [--every N] [--outer 'gemm_half_dim=32,128 ...']
        [--ranking-grid]

The fit, its fast exact path and the ranking grid are megatron_ext/calibration/
host_fit.py (its docstring says what each mode does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from megatron_ext.calibration.host_fit import (
    FIT_SOURCE,
    GRIDS,
    HOST_FIELDS,
    check,
    check_fast_path,
    fast_predict,
    fast_row,
    fit,
    loss,
    parse_outer,
    profile_with,
    ranking_grid,
    shipped,
)
from megatron_ext.calibration.rows import build_plan
from megatron_ext.calibration.sources import DEFAULT_DATA
from megatron_ext.calibration.vtrain import vtrain_rows
from megatron_ext.planner.cost import compute as C


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--fit", default=FIT_SOURCE, help="source-name prefix of the fit rows")
    p.add_argument("--json", default=None)
    p.add_argument("--every", type=int, default=1, help="fit on every n-th fit row (speed)")
    p.add_argument("--ablate", action="store_true", help="also refit with each host term off")
    p.add_argument("--polish", action="store_true",
                   help="also report the least-squares optimum off the grids (Nelder-Mead)")
    p.add_argument("--split-hidden", action="store_true",
                   help="also fit on the fit rows of one hidden size and score the others")
    p.add_argument("--ranking-grid", action="store_true",
                   help="score the ranking targets on the fit rows' sweeps at every point of "
                   "RANKING_GRID and exit")
    p.add_argument("--outer", default="", help="also try these kernel constants, e.g. "
                   "'gemm_efficiency=0.72,0.76 gemm_half_dim=64,128' (each combination: host "
                   "constants refitted, check sets scored)")
    args = p.parse_args(argv)
    rows = json.loads(Path(args.data).read_text())["rows"] + vtrain_rows()
    fit_rows = [r for r in rows if str(r["source"]).startswith(args.fit)][::args.every]
    if not fit_rows:
        print(f"--fit {args.fit!r}: no rows of that source", file=sys.stderr)
        return 2
    plans = [build_plan(r) for r in fit_rows]
    if args.ranking_grid:  # the fit rows alone: the check sets are not scored
        base = C.ComputeProfile()
        fast = [fast_row(r, pl, base) for r, pl in zip(fit_rows, plans)]
        return print_ranking_grid(ranking_grid(fit_rows, fast, shipped(base)), args.json)
    others = [r for r in rows if not str(r["source"]).startswith(args.fit)]
    other_plans = [build_plan(r) for r in others]
    if args.outer:
        for combo in parse_outer(args.outer):
            base = C.ComputeProfile(**combo)
            fast = [fast_row(r, pl, base) for r, pl in zip(fit_rows, plans)]
            start = shipped(base)
            fitted, fitted_loss = fit(fast, start)
            ratios = [fast_predict(r, fitted) / r.measured_s for r in fast]
            med = statistics.median(abs(x - 1) for x in ratios)
            checks = check(others, other_plans, profile_with(base, fitted))
            print(f"{combo}: fit loss {fitted_loss:.4f} median {100 * med:.1f}% host "
                  + " ".join(f"{n[5:]}={fitted[n]:.3g}" for n in HOST_FIELDS) + " | "
                  + "; ".join(f"{k} {100 * v['median_abs_error']:.1f}%"
                              for k, v in checks.items()), flush=True)
        return 0
    base = C.ComputeProfile()
    fast = [fast_row(r, pl, base) for r, pl in zip(fit_rows, plans)]
    start = shipped(base)
    off = {**start, "host_kernel_s": 0.0, "host_collective_step_s": 0.0,
           "host_microbatch_s": 0.0}
    fitted, fitted_loss = fit(fast, start)
    if args.polish:
        polished, polished_loss = fit(fast, start, polished=True)
        ratios = [fast_predict(r, polished) / r.measured_s for r in fast]
        print("least-squares optimum (Nelder-Mead from the grid's best): "
              + " ".join(f"{n[5:]}={polished[n]:.3g}" for n in HOST_FIELDS)
              + f", mean squared log error {polished_loss:.4f}, median |error| "
              f"{100 * statistics.median(abs(x - 1) for x in ratios):.1f}%")
    drift = check_fast_path(fit_rows, plans, fast, base, fitted)
    print(f"fit rows {len(fast)}: mean squared log error off {loss(fast, off):.4f}, shipped "
          f"{loss(fast, start):.4f}, fitted {fitted_loss:.4f} (fast path vs tool: "
          f"{drift:.1e})")
    for name in HOST_FIELDS:
        print(f"  {name} = {fitted[name]:.3g} (shipped {start[name]:.3g})")
    ablation = {}
    if args.ablate:
        for name in ("host_kernel_s", "host_collective_step_s", "host_microbatch_s"):
            saved = GRIDS[name]
            GRIDS[name] = [0.0]  # a one-value grid: polish keeps it too
            _, ablation[name] = fit(fast, {**fitted, name: 0.0})
            GRIDS[name] = saved
            print(f"  without {name} (the others refitted): mean squared log error "
                  f"{ablation[name]:.4f}")
    split = {}
    if args.split_hidden:
        hidden = [int(r["hidden_size"]) for r in fit_rows]
        for h in sorted(set(hidden)):
            train = [f for f, x in zip(fast, hidden) if x == h]
            test = [f for f, x in zip(fast, hidden) if x != h]
            c, _ = fit(train, start)
            err = statistics.median(abs(fast_predict(r, c) / r.measured_s - 1) for r in test)
            split[h] = {"fitted": c, "others_median_abs_error": err}
            print(f"  fitted on hidden {h} only ({len(train)} rows): "
                  + " ".join(f"{n[5:]}={c[n]:.3g}" for n in HOST_FIELDS)
                  + f"; the other {len(test)} rows: median |error| {100 * err:.1f}%")
    ratios = [fast_predict(r, fitted) / r.measured_s for r in fast]
    print(f"  fit rows median |error| {100 * statistics.median(abs(x - 1) for x in ratios):.1f}%"
          f", median pred/meas {statistics.median(ratios):.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"fitted": fitted, "shipped": start,
                                               "loss": fitted_loss, "fast_path_drift": drift,
                                               "loss_without": ablation,
                                               "split_hidden": split},
                                              indent=1))
    return 0


def print_ranking_grid(points: list[dict[str, Any]], json_path: str | None) -> int:
    best = max(points, key=lambda q: (q["merged"]["meet"], -q["median_abs_error"]))
    print("host constants (kernel us, ring step us, power, per micro-batch ms): median |error|;"
          " sweeps of >= 8 layouts meeting both targets, merged / at one GPU count; max regret")
    for q in points:
        c = q["constants"]
        tag = " (shipped)" if q["shipped"] else " (most sweeps)" if q is best else ""
        print(f"  {1e6 * c['host_kernel_s']:5.1f} {1e6 * c['host_collective_step_s']:4.0f} "
              f"{c['host_overlap_power']:4.2f} {1e3 * c['host_microbatch_s']:4.2f}: "
              f"{100 * q['median_abs_error']:5.1f}%; {q['merged']['meet']} of "
              f"{q['merged']['sweeps']} / {q['one_gpu_count']['meet']} of "
              f"{q['one_gpu_count']['sweeps']}; {100 * q['merged']['max_top1_regret']:.1f}%"
              + tag)
    if json_path:
        Path(json_path).write_text(json.dumps({"ranking_grid": points}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
