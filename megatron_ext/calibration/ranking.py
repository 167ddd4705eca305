"""Ranking metrics of predicted against measured runs: Spearman, top-1 regret and ordered
pairs within every sweep (layouts of one model on one cluster at one batch and sequence), the
reference predictor they are compared with, and per-model summaries."""

from __future__ import annotations

import math
import statistics
from typing import Any

from megatron_ext.calibration.rows import cluster_label, layout_label
from megatron_ext.calibration.vtrain import VTRAIN_SOURCES


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rho with average ranks for ties."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2.0
            i = j + 1
        return out

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else float("nan")


BIG_SWEEP = 8
"""Issue 19's ranking targets (Spearman >= 0.8, top-1 regret <= 5%) apply to sweeps of at least
this many layouts."""


def sweep_key(r: dict[str, Any]) -> tuple[str, str, int, int]:
    """A sweep: layouts of one model on one cluster at one global batch and sequence (and one
    `run_date` where the source says the cluster changed between its days)."""
    cluster = r["cluster"] + (f" {r['run_date']}" if r.get("run_date") else "")
    return (r["model"], cluster, r["global_batch_size"], r["seq_len"])


def ranking(pred: list[float], meas: list[float]) -> dict[str, float]:
    """Spearman, top-1 regret (measured cost of the predicted-best over the measured-best, minus
    1) and the share of pairs (measured not tied) the prediction orders as measured."""
    best = min(range(len(pred)), key=lambda i: pred[i])
    pairs = [(i, j) for i in range(len(pred)) for j in range(i + 1, len(pred))
             if meas[i] != meas[j]]
    right = sum((pred[i] - pred[j]) * (meas[i] - meas[j]) > 0 for i, j in pairs)
    return {
        "spearman": spearman(pred, meas),
        "top1_regret": meas[best] / min(meas) - 1.0,
        "pairs_ordered": right / len(pairs) if pairs else float("nan"),
    }


def baseline_steps(num_microbatches: int, pp: int, num_layers: int) -> float:
    """Issue 19's reference predictor: micro-batch steps of the 1F1B schedule (m + pp - 1) x
    layers per stage, i.e. a fixed cost per layer per micro-batch whatever the layer's size."""
    return float((num_microbatches + pp - 1) * math.ceil(num_layers / pp))


def gpu_s_per_token(row: dict[str, Any]) -> float:
    """GPU-seconds per token of one second of the row's iteration: GPUs / tokens per
    iteration (ranks layouts of one sweep across GPU counts)."""
    return row["num_gpus"] / (row["global_batch_size"] * row["seq_len"])


def sweep_fields(row: dict[str, Any], *, measured_s: float, num_microbatches: int, pp: int,
                 num_layers: int) -> dict[str, Any]:
    """What `sweeps` reads of a row, but the prediction: its sweep (sweep_key), layout, GPUs,
    and the measured and reference-predictor GPU-seconds per token."""
    gpu_token = gpu_s_per_token(row)
    return {
        "source": row["source"], "model": row["model_name"], "gpus": row["num_gpus"],
        "cluster": cluster_label(row), "layout": layout_label(row),
        "run_date": row.get("run_date"),
        "global_batch_size": row["global_batch_size"], "seq_len": row["seq_len"],
        "measured_gpu_s_per_token": measured_s * gpu_token,
        "baseline_gpu_s_per_token": gpu_token * baseline_steps(num_microbatches, pp, num_layers),
    }


def sweeps(results: list[dict[str, Any]], key: str = "predicted_gpu_s_per_token",
           per_gpu_count: bool = False) -> list[dict[str, Any]]:
    """Ranking within every sweep of >= 2 layouts, on GPU-seconds per token (iteration time x
    GPUs / tokens: at one GPU count the same order as iteration time, across GPU counts the cost
    of a token); `baseline`: the same metrics for baseline_steps(). per_gpu_count: a sweep is
    also one GPU count (the layouts a user could pick for the GPUs they have)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((*sweep_key(r), r["gpus"] if per_gpu_count else None), []).append(r)
    out = []
    for (model, cluster, gbs, seq, gpus), members in groups.items():
        if len({(m["layout"], m["gpus"]) for m in members}) < 2:
            continue
        meas = [m["measured_gpu_s_per_token"] for m in members]
        out.append({
            "model": model, "cluster": cluster, "global_batch_size": gbs, "seq_len": seq,
            **({"gpus": gpus} if per_gpu_count else {}),
            "source": members[0]["source"], "layouts": len(members),
            **ranking([m[key] for m in members], meas),
            "baseline": ranking([m["baseline_gpu_s_per_token"] for m in members], meas),
        })
    return out


def meets_targets(sweep: dict[str, Any]) -> bool:
    """Issue 19's ranking targets for a sweep of >= BIG_SWEEP layouts."""
    return sweep["spearman"] >= 0.8 and sweep["top1_regret"] <= 0.05


def sweep_summary(sw: list[dict[str, Any]]) -> dict[str, Any]:
    """The sweeps of >= BIG_SWEEP layouts: how many, median / min Spearman, how many meet the
    targets, and the same for the reference predictor."""
    big = [g for g in sw if g["layouts"] >= BIG_SWEEP]
    if not big:
        return {"sweeps": len(sw), "big_sweeps": 0}
    rho = [g["spearman"] for g in big]
    base = [g["baseline"]["spearman"] for g in big]
    return {
        "sweeps": len(sw), "big_sweeps": len(big),
        "median_spearman": statistics.median(rho), "min_spearman": min(rho),
        "median_top1_regret": statistics.median(g["top1_regret"] for g in big),
        "max_top1_regret": max(g["top1_regret"] for g in big),
        "median_pairs_ordered": statistics.median(g["pairs_ordered"] for g in big),
        "meeting_targets": sum(meets_targets(g) for g in big),
        "baseline_median_spearman": statistics.median(base),
        "baseline_min_spearman": min(base),
        "baseline_meeting_targets": sum(meets_targets(g["baseline"]) for g in big),
    }


def model_summaries(results: list[dict[str, Any]], sw: list[dict[str, Any]],
                    held_sw: list[dict[str, Any]], sw_gpus: list[dict[str, Any]]
                    ) -> list[dict[str, Any]]:
    """One line per model of the sources summarised rather than listed (VTRAIN_SOURCES): its
    rows' error and its sweeps' ranking, with the reference predictor's and held out."""
    out = []
    keys = sorted({(r["source"], r["model"]) for r in results if r["source"] in VTRAIN_SOURCES},
                  key=lambda k: (k[0], float(k[1].split()[1].rstrip("B"))))
    for source, model in keys:
        members = [r for r in results if (r["source"], r["model"]) == (source, model)]
        ratios = [r["ratio"] for r in members]
        entry = {"source": source, "model": model, "rows": len(members),
                 "median_abs_error": statistics.median(abs(x - 1) for x in ratios),
                 "median_ratio": statistics.median(ratios),
                 "min_ratio": min(ratios), "max_ratio": max(ratios),
                 "memory_false_negatives": sum(not r["fits"] for r in members),
                 **sweep_summary([g for g in sw if (g["source"], g["model"]) == (source, model)])}
        entry["one_gpu_count"] = sweep_summary(
            [g for g in sw_gpus if (g["source"], g["model"]) == (source, model)])
        held = sweep_summary([g for g in held_sw if (g["source"], g["model"]) == (source, model)])
        if held.get("big_sweeps"):
            entry["held_out_median_spearman"] = held["median_spearman"]
            entry["held_out_meeting_targets"] = held["meeting_targets"]
        out.append(entry)
    return out
