"""Every published run predicted by the cost model, the way `megatron-ext evaluate` scores a plan:
the run's plan (rows.build_plan) on its cluster (rows.cluster_of) with its execution settings
(rows.run_settings) through planner.cost.evaluate's plan_training and evaluate, the function
the command calls; then the errors, rankings and the held-out refit of all of them (`run`).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from typing import Any

from megatron_ext.calibration.ranking import (
    BIG_SWEEP,
    gpu_s_per_token,
    model_summaries,
    spearman,
    sweep_fields,
    sweep_summary,
    sweeps,
)
from megatron_ext.calibration.residuals import (
    GEMM_EFFICIENCY_GRID,
    leave_one_source_out,
)
from megatron_ext.calibration.rows import (
    build_plan,
    cluster_label,
    cluster_of,
    compute_of,
    measured_iteration_s,
    run_settings,
)
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.cost import interval as iv
from megatron_ext.planner.cost.compute import ComputeProfile
from megatron_ext.planner.cost.evaluate import evaluate, plan_training
from megatron_ext.planner.cost.model import CostModel

GIB = 2**30


def predict(row: dict[str, Any], plan: ParallelPlan,
            compute: ComputeProfile | None = None) -> dict[str, Any]:
    """Predicted iteration time and peak memory of the plan on the row's cluster (`compute`: the
    calibrated kernel constants, default the cost model's): what `megatron-ext evaluate
    PLAN.json` with rows.evaluate_flags(row) prints for the plan on cluster_of(row)."""
    cm = CostModel(plan.model, cluster_of(row), plan_training(plan, **run_settings(row)),
                   compute=compute_of(row, compute or ComputeProfile()))
    ev = evaluate(cm, plan.layout)
    peak = max(ev.stage_peak_bytes)
    return {
        "predicted_s": ev.iteration_s,
        "peak_gib": peak / GIB,
        "cap_gib": cm.memory_cap_bytes / GIB,
        "fits": ev.feasible,
        "num_microbatches": plan.num_microbatches,
    }


def quoted_memory_gb(row: dict[str, Any]) -> float | None:
    """The per-GPU memory a row's quoted table reports in its `Mem` column ("56GB"), or None.
    The quote holds the table's header and the row (`| ... | Mem | ... | row: | ... | 56GB |`)."""
    quote = str(row.get("quote", ""))
    if "row:" not in quote:
        return None
    header, cells = quote.rsplit("row:", 1)
    names = [c.strip() for c in header[header.find("|"):].split("|")]
    values = [c.strip() for c in cells.split("|")]
    if "Mem" not in names or len(names) != len(values):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*GB", values[names.index("Mem")])
    return float(match.group(1)) if match else None


def out_of_memory_boundary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The layouts a source reports as out of memory, predicted like its rows: how many the
    cost model says do not fit (the fit boundary from the other side of memory_false_negatives:
    runs that ran but are predicted not to fit)."""
    out = []
    for record in records:
        p = predict(record, build_plan(record))
        out.append({"id": record["id"], "source": record["source"], "fits": p["fits"],
                    "peak_gib": p["peak_gib"], "cap_gib": p["cap_gib"]})
    return {"layouts": len(out), "predicted_not_to_fit": sum(not r["fits"] for r in out),
            "records": out}


def reported_memory(rows: list[dict[str, Any]], results: list[dict[str, Any]]
                    ) -> dict[str, Any]:
    """Predicted peak memory (evaluate's, its reserve for the CUDA context and fragmentation
    included) over the per-GPU memory the rows' sources report. Only BigScience's tr11 tables
    report it: nvidia-smi's used memory on the job's first node ("was quickly getting the memory
    snapshot with: `pdsh -w jean-zay-iam01 ... nvidia-smi`", chronicles-prequel.md), i.e. the
    CUDA context and the caching allocator's reserved blocks, not only live tensors; read as
    GiB (nvidia-smi counts MiB). Nothing is fitted to it."""
    by_id = {r["id"]: r for r in results}
    pairs = [(row["id"], by_id[row["id"]]["peak_gib"] / gb) for row in rows
             if (gb := quoted_memory_gb(row)) is not None and row["id"] in by_id]
    ratios = [ratio for _, ratio in pairs]
    return {"rows": len(pairs),
            "median_ratio": statistics.median(ratios) if ratios else float("nan"),
            "min_ratio": min(ratios, default=float("nan")),
            "max_ratio": max(ratios, default=float("nan")),
            "within_10pct": sum(abs(r - 1) <= 0.10 for r in ratios),
            "ratios": dict(pairs)}


def run(rows: list[dict[str, Any]], *, loso: bool = True) -> dict[str, Any]:
    """Every row predicted once per gemm_efficiency of the grid (the shipped value's prediction
    is the grid's, not a second one); the held-out refits reuse these predictions."""
    default = ComputeProfile()
    profiles = ([dataclasses.replace(default, gemm_efficiency=g) for g in GEMM_EFFICIENCY_GRID]
                if loso and len({r["source"] for r in rows}) > 1 else [])
    shipped = profiles.index(default) if default in profiles else None
    results: list[dict[str, Any]] = []
    grid_pred: list[list[float]] = [[] for _ in profiles]
    for row in rows:
        plan = build_plan(row)
        measured, how = measured_iteration_s(row)
        preds = [predict(row, plan, c) for c in profiles]
        for k, p in enumerate(preds):
            grid_pred[k].append(p["predicted_s"])
        pred = preds[shipped] if shipped is not None else predict(row, plan)
        fields = sweep_fields(row, measured_s=measured, num_microbatches=pred["num_microbatches"],
                              pp=plan.pp, num_layers=plan.model.num_layers)
        results.append({
            "id": row["id"], **fields,
            "features": iv.plan_features(num_gpus=row["num_gpus"],
                                         micro_batch_size=iv.replica_micro_batch(plan),
                                         pp=plan.pp,
                                         precision=plan.precision, cluster=cluster_label(row)),
            "not_for_calibration": row.get("not_for_calibration"),
            "measured_s": measured, "measured_from": how, **pred,
            "ratio": pred["predicted_s"] / measured,
            "predicted_gpu_s_per_token": pred["predicted_s"] * gpu_s_per_token(row),
            "grid_predicted_s": [p["predicted_s"] for p in preds],
        })
    errors = [abs(r["ratio"] - 1) for r in results]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["source"], r["model"]), []).append(r)
    rank: list[dict[str, Any]] = []
    for (source, model), members in groups.items():
        if len({m["layout"] for m in members}) < 2:
            continue
        rank.append({
            "source": source, "model": model, "rows": len(members),
            "spearman": spearman([m["predicted_gpu_s_per_token"] for m in members],
                                 [m["measured_gpu_s_per_token"] for m in members]),
        })
    held_out: dict[str, Any] = {}
    if profiles:
        held_out = leave_one_source_out(results, grid_pred)
    sw, sw_gpus = sweeps(results), sweeps(results, per_gpu_count=True)
    held_sw = held_out.get("sweeps", [])
    by_source = {src: sweep_summary([g for g in sw if g["source"] == src])
                 for src in sorted({g["source"] for g in sw})}
    by_source_gpus = {src: sweep_summary([g for g in sw_gpus if g["source"] == src])
                      for src in sorted({g["source"] for g in sw_gpus})}
    return {
        "rows": results,
        "sweep_summary": {
            "all": sweep_summary(sw), "held_out": sweep_summary(held_sw), "by_source": by_source,
            "one_gpu_count": sweep_summary(sw_gpus),
            "one_gpu_count_held_out": sweep_summary(held_out.get("sweeps_one_gpu_count", [])),
            "one_gpu_count_by_source": by_source_gpus,
        },
        "model_summaries": model_summaries(results, sw, held_sw, sw_gpus),
        "summary": {
            "rows": len(results),
            "median_abs_error": statistics.median(errors) if errors else float("nan"),
            "mean_abs_error": statistics.fmean(errors) if errors else float("nan"),
            "within_15pct": sum(e <= 0.15 for e in errors),
            "optimistic": sum(r["ratio"] < 1 for r in results),
            "pessimistic": sum(r["ratio"] > 1 for r in results),
            "median_ratio": statistics.median(r["ratio"] for r in results) if results else 1.0,
            "memory_false_negatives": [r["id"] for r in results if not r["fits"]],
            "reported_memory": reported_memory(rows, results),
            "min_group_spearman": min((g["spearman"] for g in rank), default=float("nan")),
            "min_sweep_spearman": min((g["spearman"] for g in sw), default=float("nan")),
            "max_sweep_top1_regret": max((g["top1_regret"] for g in sw), default=float("nan")),
            "min_big_sweep_spearman": min((g["spearman"] for g in sw if g["layouts"] >= BIG_SWEEP),
                                          default=float("nan")),
            "max_big_sweep_top1_regret": max(
                (g["top1_regret"] for g in sw if g["layouts"] >= BIG_SWEEP), default=float("nan")),
            "loso_median_abs_error": held_out.get("median_abs_error", float("nan")),
            "loso_interval_coverage": held_out.get("interval_coverage", float("nan")),
        },
        "rank_groups": rank,
        "sweeps": sw,
        "sweeps_one_gpu_count": sw_gpus,
        "leave_one_source_out": held_out,
    }
