"""What-if checks of the cost model's missing tensor-parallel cost on Jean Zay (BLOOM's topology
search, issue 19): which physical cause fits the measured runs, and which does not.

    python tools/bench_tp_gap.py [--json OUT.json]

The candidates and how each is priced: megatron_ext/calibration/tp_gap.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_ext.calibration.sources import DEFAULT_DATA
from megatron_ext.calibration.tp_gap import (
    JEAN_ZAY,
    candidates,
    ceiling_sweep,
    launch_blocking_check,
)
from megatron_ext.warning_filters import install as install_warning_filters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    rows = json.loads(Path(args.data).read_text())["rows"]
    results, ceiling, extra = candidates(rows)
    print(f"{'candidate':46s} {'all':>6s} {'!BLOOM':>6s}  BLOOM pred/meas by TP"
          "                     1-node pred/meas       sweeps (layouts: Spearman / regret)")
    for r in results:
        tps = " ".join(f"{k}:{v[0]:.2f}-{v[1]:.2f}" for k, v in r["bloom_ratio_by_tp"].items())
        sw = "; ".join(f"{s['layouts']}: {s['spearman']:.2f}/{100 * s['top1_regret']:.0f}%"
                       for s in r["bloom_sweeps"])
        one = ",".join(f"{x:.2f}" for x in r["single_node_ratio"])
        print(f"{r['candidate']:46s} {100 * r['median_abs_error_all']:5.1f}% "
              f"{100 * r['median_abs_error_not_bloom']:5.1f}%  {tps:40s} {one:22s} {sw}")
    print(f"\nnoise ceiling on the {len(ceiling_sweep(rows))}-layout sweep (a perfect model, "
          "measured times with lognormal noise sigma):")
    for c in ceiling:
        print(f"  sigma {100 * c['sigma']:.1f}%: median Spearman {c['median_spearman']:.3f}, "
              f"P(Spearman >= 0.8) {c['p_at_least_0_8']:.2f}")
    template = next(r for r in rows if r.get("cluster_label") == JEAN_ZAY)
    pairs = launch_blocking_check(template)
    print("\nsynchronous launches on the chronicle's 200B (TP 8, PP 10, micro-batch 1): time with "
          "CUDA_LAUNCH_BLOCKING=1 over without")
    print(f"  {'GPUs':>5s} {'GBS':>5s} {'measured':>9s} {'predicted':>9s}")
    for p in pairs:
        print(f"  {p['gpus']:5d} {p['global_batch_size']:5d} {p['measured_slowdown']:9.3f} "
              f"{p['predicted_slowdown']:9.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"candidates": results, "noise_ceiling": ceiling, "single_node_rows": extra,
             "launch_blocking_pairs": pairs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    install_warning_filters()
    sys.exit(main())
