"""Coverage of the prediction intervals per held-out source group under other rules for a plan
whose cluster no calibrating run shares (docs/benchmarks.md, "Why the papers group is at 98%").

    python tools/bench_published.py --json bench_published.json
    python tools/bench_interval_rules.py bench_published.json [--json rules.json]

Reads the held-out residuals of bench_published.py's rows (`loso_log_residual`, `features`,
`source`), builds the interval table without each source in turn (as bench_published.py does)
and scores that source's rows under each rule. Only the shipped rule is the package's
(planner/cost/interval.py); the others are the alternatives tried.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_ext.planner.cost import interval as iv  # noqa: E402

Bounds = Callable[[dict[str, Any], dict[str, str]], tuple[float, float]]


def _groups(table: dict[str, Any], feats: dict[str, str]) -> tuple[list[float], list[float],
                                                                    bool]:
    lows, highs, unseen = [0.0], [0.0], False
    for feature in iv.FEATURES:
        group = table["groups"].get(feature, {}).get(feats[feature])
        if group is None or group["runs"] < iv.MIN_RUNS:
            unseen = True
        else:
            lows.append(group["low"])
            highs.append(group["high"])
    return lows, highs, unseen


def shipped(table: dict[str, Any], feats: dict[str, str]) -> tuple[float, float]:
    low, high, _ = iv.log_bounds(table, feats)
    return low, high


def pooled(table: dict[str, Any], feats: dict[str, str]) -> tuple[float, float]:
    lows, highs, unseen = _groups(table, feats)
    low, high = iv._combine(table, min(lows), max(highs))
    if unseen:
        low, high = min(low, table["all"]["low"]), max(high, table["all"]["high"])
    return low, high


def envelope(table: dict[str, Any], feats: dict[str, str]) -> tuple[float, float]:
    lows, highs, unseen = _groups(table, feats)
    if unseen:
        for groups in table["groups"].values():
            for g in groups.values():
                if g["runs"] >= iv.MIN_RUNS:
                    lows.append(g["low"])
                    highs.append(g["high"])
    return iv._combine(table, min(lows), max(highs))


def node(cluster: str) -> str:
    """The GPU node a cluster label runs on (every label of these sources is an A100 node)."""
    return "a100" if "a100" in cluster else cluster


RULES: dict[str, tuple[Bounds, Callable[[str], str]]] = {
    "shipped: the extremes of all runs": (shipped, lambda c: c),
    "cluster feature keyed on the GPU node": (shipped, node),
    "pooled 5%/95% quantiles of all runs": (pooled, lambda c: c),
    "envelope of every group's quantiles": (envelope, lambda c: c),
}


def group_of(source: str) -> str:
    if source.startswith("vTrain"):
        return "vTrain"
    if source.startswith("Lucie"):
        return "Lucie-7B"
    return "papers and READMEs"


def score(rows: list[dict[str, Any]], bounds: Bounds, key: Callable[[str], str]
          ) -> dict[str, float]:
    runs = [({**r["features"], "cluster": key(r["features"]["cluster"])},
             r["loso_log_residual"], r["source"], not r.get("not_for_calibration"))
            for r in rows]
    hits: dict[str, list[bool]] = {}
    for src in sorted({s for _, _, s, _ in runs}):
        table = iv.build_table([(f, r, s) for f, r, s, c in runs if s != src and c])
        for f, r, s, _ in runs:
            if s != src:
                continue
            low, high = bounds(table, f)
            for name in (group_of(s), *(["BLOOM alone"] if "BLOOM" in s else [])):
                hits.setdefault(name, []).append(low <= r <= high)
    return {name: statistics.fmean(v) for name, v in sorted(hits.items())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("published_json", help="bench_published.py --json output (with the refit)")
    p.add_argument("--json", default=None, help="write the table here")
    args = p.parse_args(argv)
    rows = json.loads(Path(args.published_json).read_text())["rows"]
    if not rows or "loso_log_residual" not in rows[0]:
        print(f"{args.published_json}: no held-out residuals (run bench_published.py without "
              "--no-loso)", file=sys.stderr)
        return 2
    out = {name: score(rows, bounds, key) for name, (bounds, key) in RULES.items()}
    names = sorted({g for v in out.values() for g in v})
    print(f"{'rule':40s} " + " ".join(f"{n:>19s}" for n in names))
    for rule, cov in out.items():
        print(f"{rule:40s} " + " ".join(f"{100 * cov.get(n, math.nan):18.1f}%" for n in names))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
