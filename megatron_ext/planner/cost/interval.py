"""90% prediction intervals for predicted iteration times, from the cost model's held-out errors.

The residual table (residuals_a100.json next to this file) is written by
`python tools/bench_published.py --write-residuals megatron_ext/planner/cost/residuals_a100.json`:
for every published run, log(measured / predicted) where the prediction comes from the cost model
with its calibrated constant (gemm_efficiency) fitted on the OTHER sources only
(leave-one-source-out), so each residual is an error on runs the model had not seen. The runs are
grouped by the features that drive the error:

  scale        GPUs in the run: 1-8, 9-64, 65-512, 513+
  micro_batch  samples per data-parallel replica per micro-batch (Megatron's
               --micro-batch-size; a layerwise plan: its smallest layer's): 1, 2-4, 5+
  pipeline     pipeline depth: 1, 2-8, 9+
  precision    bf16 / fp16 / fp32
  cluster      cluster preset the run is priced on

A residual r of a run of source s is split into the source's offset mu_s (the median of its
runs' residuals: what one cluster, framework or way of measuring shares) and the run's own part
e = r - mu_s. Each feature group keeps the 5% and 95% quantiles of e; the sources keep the
median m of their offsets (every source counted once, however many runs it has) and the offsets'
5% and 95% quantiles. A plan's interval treats its own source as unseen, an offset drawn like
the others', independent of e:

  w_low  = max(0, -min over the plan's groups of their 5% quantiles)    (envelope of the groups)
  w_high = max(0, max over the plan's groups of their 95% quantiles)
  s_low  = m - 5% quantile of the offsets,  s_high = 95% quantile of the offsets - m
  low  = predicted x exp(m - sqrt(w_low^2 + s_low^2))
  high = predicted x exp(m + sqrt(w_high^2 + s_high^2))

A feature whose group holds fewer than MIN_RUNS runs (or none: an H100 preset, fp32) widens the
interval to at least the extremes of all runs, so a plan unlike the measured runs gets the
widest interval the data gives, never a narrow one. tools/bench_published.py reports the
coverage of this rule per held-out source (each source's runs scored against a table built
without that source).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

from megatron_ext.plan import ParallelPlan

FEATURES = ("scale", "micro_batch", "pipeline", "precision", "cluster")
LOW_Q, HIGH_Q = 0.05, 0.95
"""The interval's quantiles of log(measured / predicted): a central 90% interval."""
MIN_RUNS = 4
"""Fewest runs a feature group needs before its own quantiles are used."""
TABLE_PATH = Path(__file__).with_name("residuals_a100.json")


def _bucket(value: int, edges: tuple[tuple[int, str], ...], last: str) -> str:
    for edge, name in edges:
        if value <= edge:
            return name
    return last


def plan_features(
    *, num_gpus: int, micro_batch_size: int, pp: int, precision: str, cluster: str
) -> dict[str, str]:
    """The feature groups a run or a plan falls in (see the module docstring)."""
    return {
        "scale": _bucket(num_gpus, ((8, "1-8"), (64, "9-64"), (512, "65-512")), "513+"),
        "micro_batch": _bucket(micro_batch_size, ((1, "1"), (4, "2-4")), "5+"),
        "pipeline": _bucket(pp, ((1, "1"), (8, "2-8")), "9+"),
        "precision": str(precision),
        "cluster": str(cluster),
    }


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), without numpy."""
    v = sorted(values)
    if not v:
        raise ValueError("quantile of no values")
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def build_table(runs: list[tuple[dict[str, str], float, str]]) -> dict[str, Any]:
    """Source offsets and group quantiles of the runs' own parts (module docstring) from
    (features, log(measured / predicted), source) triples."""
    residuals = [r for _, r, _ in runs]
    by_source: dict[str, list[float]] = {}
    for _, r, source in runs:
        by_source.setdefault(source, []).append(r)
    offsets = {s: quantile(v, 0.5) for s, v in sorted(by_source.items())}
    groups: dict[str, dict[str, Any]] = {}
    for feature in FEATURES:
        values: dict[str, list[float]] = {}
        for feats, r, source in runs:
            values.setdefault(feats[feature], []).append(r - offsets[source])
        groups[feature] = {
            name: {"runs": len(v), "low": quantile(v, LOW_Q), "high": quantile(v, HIGH_Q)}
            for name, v in sorted(values.items())
        }
    mu = list(offsets.values())
    return {
        "runs": len(residuals),
        "all": {"low": quantile(residuals, LOW_Q), "high": quantile(residuals, HIGH_Q),
                "min": min(residuals), "max": max(residuals)},
        "sources": {"median": quantile(mu, 0.5), "low": quantile(mu, LOW_Q),
                    "high": quantile(mu, HIGH_Q),
                    "offsets": {s: {"runs": len(by_source[s]), "offset": o}
                                for s, o in offsets.items()}},
        "groups": groups,
    }


def _combine(table: dict[str, Any], low_q: float, high_q: float) -> tuple[float, float]:
    """(low, high) of log(measured / predicted) from the groups' envelope (low_q, high_q) and
    the spread of the source offsets (module docstring)."""
    src = table["sources"]
    m = src["median"]
    w_low, w_high = max(0.0, -low_q), max(0.0, high_q)
    s_low, s_high = m - src["low"], src["high"] - m
    return m - math.hypot(w_low, s_low), m + math.hypot(w_high, s_high)


def log_bounds(table: dict[str, Any], feats: dict[str, str]) -> tuple[float, float, list[str]]:
    """(low, high) of log(measured / predicted) for a run with these features, and the features
    whose group had too few runs (they contributed the extremes of all runs)."""
    lows, highs, unseen = [0.0], [0.0], []
    for feature in FEATURES:
        group = table["groups"].get(feature, {}).get(feats[feature])
        if group is None or group["runs"] < MIN_RUNS:
            unseen.append(f"{feature}={feats[feature]}")
        else:
            lows.append(group["low"])
            highs.append(group["high"])
    low, high = _combine(table, min(lows), max(highs))
    if unseen:
        low, high = min(low, table["all"]["min"]), max(high, table["all"]["max"])
    return low, high, unseen


def replica_micro_batch(plan: ParallelPlan) -> int:
    """Samples per replica per micro-batch (plan.micro_batch_size is summed over the data-parallel
    replicas); the smallest over the plan's layers (the narrowest GEMMs)."""
    return max(1, min(plan.micro_batch_size // s.dp for s in plan.layers))


def plan_interval(plan: ParallelPlan, predicted_s: float, cluster: str
                  ) -> tuple[float, float, tuple[str, ...]]:
    """prediction_interval for a plan on the named cluster preset."""
    return prediction_interval(
        predicted_s, num_gpus=plan.world_size, micro_batch_size=replica_micro_batch(plan),
        pp=plan.pp, precision=plan.precision, cluster=cluster)


def with_interval(plan: ParallelPlan, cluster: str | None = None) -> ParallelPlan:
    """The plan with prediction.iteration_time_interval_s set (cluster: the preset the plan is
    priced on, default plan.cluster.name); unchanged when it has no prediction."""
    pred = plan.prediction
    if pred is None:
        return plan
    name = cluster if cluster is not None else (plan.cluster.name if plan.cluster else "custom")
    low, high, _ = plan_interval(plan, pred.iteration_time_s, name)
    return dataclasses.replace(plan, prediction=dataclasses.replace(
        pred, iteration_time_interval_s=(round(low, 6), round(high, 6))))


def search_relax(*, num_gpus: int, precision: str, cluster: str) -> float:
    """exp of the least upper end the groups a search cannot change (scale, precision, cluster)
    allow: every layout of the search has an upper end >= predicted x this, so one predicted
    slower than (best upper end) / this cannot have a lower upper end."""
    table = load_table()
    feats = plan_features(num_gpus=num_gpus, micro_batch_size=1, pp=1, precision=precision,
                          cluster=cluster)
    highs, unseen = [0.0], False
    for feature in ("scale", "precision", "cluster"):
        group = table["groups"].get(feature, {}).get(feats[feature])
        if group is not None and group["runs"] >= MIN_RUNS:
            highs.append(group["high"])
        else:
            unseen = True
    high = _combine(table, 0.0, max(highs))[1]
    return math.exp(max(high, table["all"]["max"]) if unseen else high)


def overlap_relax() -> float:
    """exp of minus the lowest lower end any layout can get: a layout predicted slower than (an
    upper end) x this has its lower end above that upper end."""
    table = load_table()
    deepest = min([0.0] + [g["low"] for groups in table["groups"].values()
                           for g in groups.values() if g["runs"] >= MIN_RUNS])
    return math.exp(-min(_combine(table, deepest, 0.0)[0], table["all"]["min"]))


@functools.lru_cache(maxsize=1)
def load_table(path: str = str(TABLE_PATH)) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))["table"]


@functools.lru_cache(maxsize=256)
def _cached_bounds(items: tuple[tuple[str, str], ...]) -> tuple[float, float, tuple[str, ...]]:
    low, high, unseen = log_bounds(load_table(), dict(items))
    return low, high, tuple(unseen)


def prediction_interval(
    predicted_s: float, *, num_gpus: int, micro_batch_size: int, pp: int, precision: str,
    cluster: str,
) -> tuple[float, float, tuple[str, ...]]:
    """90% interval [low, high] in seconds around `predicted_s`, and the features outside the
    measured runs (empty when every feature had enough runs)."""
    feats = plan_features(num_gpus=num_gpus, micro_batch_size=micro_batch_size, pp=pp,
                          precision=precision, cluster=cluster)
    low, high, unseen = _cached_bounds(tuple(sorted(feats.items())))
    return predicted_s * math.exp(low), predicted_s * math.exp(high), unseen
