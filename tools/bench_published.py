"""The GPU cost model against published A100 training runs: predicted vs measured iteration time.

    python tools/bench_published.py [--data PATH] [--json OUT.json] [--rows ID ...]

Each row of the data file (default tools/data/published_runs_a100.json, `about` says what it
holds; every row cites its source and quotes it) is one measured run of a dense GPT model with
its layout. For every row this
  1. writes the run as Megatron-LM flags and builds its plan with plan-from-args (ZeRO-3 rows:
     --use-distributed-optimizer, then zero=3 on every layer, see build_plan; interleaved runs:
     --num-virtual-stages-per-pipeline-rank);
  2. predicts the iteration time as `megatron-ext evaluate` does, on the cluster preset the run
     used (dgx-a100-80g, or dgx-a100-40g for 40 GB GPUs and the 2020 DGX A100) with how the run
     executed (rows.evaluate_flags: --no-flash-attention, --no-dropout, --engine deepspeed);
  3. converts the measured figure to seconds per iteration with the source's own convention
     (`measured_unit`, `flops_convention`): TFLOP/s per GPU under Narayanan et al. eq. (3)
     -> F / (TFLOP/s x GPUs); tokens/s -> global batch x seq / tokens/s; or the iteration time.
The FP8 rows (--data tools/data/published_runs_fp8.json: MLPerf Training v5.0/v5.1 on H100,
GB200 and GB300, torchtitan's H100 Float8 runs) are scored the same way, and then held out one
source at a time with the FP8 GEMM efficiency refitted on the others (calibration/fp8_fit.py).
It prints per row predicted/measured, then the median |error|, how many rows are optimistic
(predicted faster) or pessimistic, memory false negatives (runs that ran but are predicted not
to fit) and the other side of that boundary (the file's `out_of_memory` layouts, which the
source reports as out of memory: how many are predicted not to fit), and Spearman's rank
correlation of predicted vs measured GPU-seconds per token among the layouts of one model
within one source (per-token GPU time, not iteration time, so runs on different GPU counts
compare on efficiency, not on size).

The fixed rules that fill in what the rows do not state are in
megatron_ext/calibration/rows.py; vTrain's runs (tools/data/vtrain/, --no-vtrain leaves
them out) in calibration/vtrain.py, Lucie-7B's (tools/data/lucie/, --no-lucie) in
calibration/lucie.py. Each row is predicted by calibration/scoring.py's `predict`, which scores
the run's plan with the function `megatron-ext evaluate` calls.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megatron_ext.calibration.fp8_fit import fp8_leave_one_source_out, print_fp8_report
from megatron_ext.calibration.inputs import benchmark_rows
from megatron_ext.calibration.lucie import LUCIE_DIR
from megatron_ext.calibration.report import print_report
from megatron_ext.calibration.residuals import residual_file, residual_text
from megatron_ext.calibration.scoring import out_of_memory_boundary, run
from megatron_ext.calibration.sources import DEFAULT_DATA, load_out_of_memory
from megatron_ext.calibration.vtrain import VTRAIN_DIR
from megatron_ext.errors import PlanError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=DEFAULT_DATA, help="published runs JSON")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--rows", nargs="*", default=None, help="only these row ids")
    p.add_argument("--no-loso", action="store_true",
                   help="skip the leave-one-source-out refit (9 predictions per row)")
    p.add_argument("--write-residuals", default=None, metavar="PATH",
                   help="write the intervals' residual table here (all rows, with the "
                   "leave-one-source-out refit): megatron_ext/planner/cost/residuals_a100.json")
    p.add_argument("--vtrain-dir", default=str(VTRAIN_DIR),
                   help="vTrain's measured CSVs (ground_truth_single.csv, ground_truth_multi.csv)")
    p.add_argument("--no-vtrain", action="store_true",
                   help="leave out the vTrain rows")
    p.add_argument("--lucie-dir", default=str(LUCIE_DIR),
                   help="OpenLLM-France's Lucie-7B parallelism table (expe_summary.csv)")
    p.add_argument("--no-lucie", action="store_true",
                   help="leave out the Lucie-7B rows")
    args = p.parse_args(argv)
    try:
        rows = benchmark_rows(args.data, with_vtrain=not args.no_vtrain,
                              with_lucie=not args.no_lucie, vtrain_dir=args.vtrain_dir,
                              lucie_dir=args.lucie_dir)
        oom = load_out_of_memory(args.data)
    except (PlanError, OSError) as err:
        print(f"bench_published: {err}", file=sys.stderr)
        return 2
    if args.rows:
        unknown = set(args.rows) - {r["id"] for r in rows}
        if unknown:
            print(f"--rows: unknown id(s) {sorted(unknown)}", file=sys.stderr)
            return 2
        rows = [r for r in rows if r["id"] in args.rows]
    if args.write_residuals and (args.rows or args.no_loso or args.no_vtrain):
        print("--write-residuals needs every row and the refit: drop --rows / --no-loso / "
              "--no-vtrain", file=sys.stderr)
        return 2
    wall, cpu = time.perf_counter(), time.process_time()
    out = run(rows, loso=not args.no_loso)
    out["timing"] = {"rows": len(rows), "wall_s": time.perf_counter() - wall,
                     "cpu_s": time.process_time() - cpu}
    print_report(out)
    if oom and not args.rows:
        out["out_of_memory"] = out_of_memory_boundary(oom)
        boundary = out["out_of_memory"]
        print(f"out of memory as reported: {boundary['predicted_not_to_fit']} of "
              f"{boundary['layouts']} predicted not to fit (" + ", ".join(
                  f"{r['id']} {r['peak_gib']:.1f} of {r['cap_gib']:.1f} GiB"
                  for r in boundary["records"]) + ")")
    if not args.no_loso:
        out["fp8_leave_one_source_out"] = fp8_leave_one_source_out(rows)
        print_fp8_report(out["fp8_leave_one_source_out"])
    print(f"{len(rows)} rows in {out['timing']['wall_s']:.1f} s wall, "
          f"{out['timing']['cpu_s']:.1f} s CPU")
    if args.write_residuals:
        Path(args.write_residuals).write_text(residual_text(residual_file(out["rows"])))
        print(f"wrote {args.write_residuals}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
