"""Benchmark of `megatron-ext search`: search time and predicted speedup over the best uniform
(stock Megatron-LM) layout on a fixed suite, printed as a table and written as JSON.

    python tools/bench_search.py [--json bench_search.json] [--cases NAME ...] [--moe]

--moe runs the MoE suite instead (Mixtral-8x7B, Qwen2-57B-A14B, DeepSeekMoE-16B, a memory-tight
case; the uniform baseline is Megatron-LM's MoE layout: one TP/PP/CP/DP plus EP/ETP on the MoE
layers) and scores published MoE runs' layouts with the cost model.

Speedup = plan tokens/s / best uniform tokens/s, both predicted by the same cost model.
`bound` = uniform time / the search's own lower bound on any layout's time (the relaxation the
search prunes with): no layout in the cost model can beat the uniform one by more than that.
`vs +fsdp` = speedup over a wider uniform baseline that may also use Megatron-LM's FSDP2
(ZeRO-3 on every layer, pp=1 only), which the issue's baseline leaves out.
The uniform baseline includes Megatron-LM's interleaved schedule (--num-layers-per-virtual-
pipeline-stage); `vs 1F1B unif` = speedup over the old baseline without it.
`--no-interleaving` searches without interleaving too (the space before it ran).
Search time is wall-clock (and CPU time) of one `search` call in this process; on a shared
machine the CPU time is the fairer number.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass

from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.search import _combos, search
from megatron_ext.planner.suite import MOE_SUITE, SUITE, Case
from megatron_ext.planner.training import DEFAULT_MOE_IMBALANCE, TrainingSpec
from megatron_ext.planner.uniform import search_uniform
from megatron_ext.presets import cluster_preset, model_preset
from megatron_ext.warning_filters import install as install_warning_filters


@dataclass(frozen=True, kw_only=True, slots=True)
class Published:
    """A published MoE training run on H100 (BF16) and its layout, scored with `evaluate`."""

    name: str
    model: str
    """Preset name or a HuggingFace config under tests/data/hf_configs."""
    nodes: int
    global_batch_size: int
    seq_length: int
    micro_batch_size: int
    """Per data-parallel replica, as the sources give it."""
    tp: int
    pp: int
    ep: int
    zero: int
    tokens_per_s_per_gpu: float
    source: str


PUBLISHED = (
    Published(name="Qwen3-30B-A3B 8xH100 EP8", model="Qwen3-30B-A3B", nodes=1,
              global_batch_size=512, seq_length=4096, micro_batch_size=4, tp=1, pp=1, ep=8,
              zero=3, tokens_per_s_per_gpu=12040,
              source="NeMo AutoModel performance summary (DGX-H100, BF16, TE + DeepEP, "
                     "FSDP2 over 8): 21.77 s per step"),
    Published(name="Qwen3-235B-A22B 256xH100 TP2 EP8 PP32", model="qwen3-235b-a22b", nodes=32,
              global_batch_size=2048, seq_length=4096, micro_batch_size=1, tp=2, pp=32, ep=8,
              zero=1, tokens_per_s_per_gpu=2048 * 4096 / 24.2 / 256,
              source="Megatron-MoE-ModelZoo best_practice/Qwen3 (H100, BF16, alltoall "
                     "dispatcher, VPP 3, recompute norm+act): 24.2 s per step, 200 TFLOP/s"),
)


def _published_model(name: str):
    if name == "qwen3-235b-a22b":  # Qwen/Qwen3-235B-A22B config.json
        from megatron_ext.specs import ModelSpec, MoESpec

        return ModelSpec(name=name, num_layers=94, hidden_size=4096, ffn_hidden_size=12288,
                         num_attention_heads=64, num_query_groups=4, kv_channels=128,
                         vocab_size=151936, max_position_embeddings=40960, qk_layernorm=True,
                         rotary_base=1000000, norm_epsilon=1e-6,
                         moe=MoESpec(num_experts=128, router_topk=8, ffn_hidden_size=1536,
                                     aux_loss_coeff=0.001))
    from pathlib import Path

    from megatron_ext.presets import model_from_file

    path = Path(__file__).resolve().parents[1] / "tests" / "data" / "hf_configs" / f"{name}.json"
    return model_from_file(path)


def run_published(run: Published, imbalance: float) -> dict:
    """Predicted tokens/s/GPU of a published layout (uniform, 1F1B, even stages as Megatron's
    default split) against the published figure."""
    from megatron_ext.plan import LayerStrategy, PlanLayout, VocabStrategy
    from megatron_ext.planner.cost.evaluate import evaluate

    model = _published_model(run.model)
    cluster = cluster_preset("dgx-h100", num_nodes=run.nodes)
    cm = CostModel(model, cluster, TrainingSpec(global_batch_size=run.global_batch_size,
                                                seq_length=run.seq_length,
                                                moe_imbalance=imbalance))
    width = cluster.num_gpus // run.pp
    dp = width // run.tp
    base = LayerStrategy(tp=run.tp, sp=run.tp > 1, dp=dp, zero=run.zero)
    expert = LayerStrategy(tp=run.tp, sp=run.tp > 1, dp=dp, zero=run.zero, ep=run.ep,
                           etp=1 if run.tp > 1 else None)
    layers = tuple(expert if model.is_moe_layer(i) else base for i in range(model.num_layers))
    sizes = [model.num_layers // run.pp + (k < model.num_layers % run.pp) for k in range(run.pp)]
    bounds = [0, *itertools.accumulate(sizes)]
    ev = evaluate(cm, PlanLayout(pp=run.pp, stages=tuple(zip(bounds[:-1], bounds[1:])),
                                 layers=layers, vocab=VocabStrategy(mode="tp", tp=run.tp),
                                 micro_batch_size=run.micro_batch_size * dp))
    predicted = ev.tokens_per_s / cluster.num_gpus
    return {"run": run.name, "imbalance": imbalance, "published": round(run.tokens_per_s_per_gpu),
            "predicted": round(predicted), "error": round(predicted / run.tokens_per_s_per_gpu - 1,
                                                          4),
            "feasible": ev.feasible, "peak_gib": round(max(ev.stage_peak_bytes) / 2**30, 1),
            "source": run.source}


def run_case(case: Case, sharded_zero: bool = True, interleaving: bool = True) -> dict:
    cluster = cluster_preset(case.cluster, num_nodes=case.nodes, memory_gib=case.memory_gib)
    training = TrainingSpec(global_batch_size=case.global_batch_size, seq_length=case.seq_length,
                            allow_zero3=sharded_zero, allow_interleaving=interleaving)
    cm = CostModel(model_preset(case.model), cluster, training)
    wall, cpu = time.perf_counter(), time.process_time()
    result = search(cm)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    plan, uni = result.plan, result.uniform_plan
    bound = min(c.bound_s for c in _combos(cm))
    uniform_s = result.uniform_evaluation.iteration_s if uni else math.inf
    fsdp = search_uniform(cm, fsdp=True)
    fsdp_s = fsdp[1].iteration_s if fsdp else math.inf
    plain = CostModel(cm.model, cluster, dataclasses.replace(training, allow_interleaving=False))
    old = search_uniform(plain)  # the uniform baseline before interleaving was in it
    old_s = old[1].iteration_s if old else math.inf
    return {
        "case": case.key,
        "model": case.model,
        "cluster": case.cluster,
        "gpus": cluster.num_gpus,
        "memory_gib": cluster.memory_gib,
        "global_batch_size": case.global_batch_size,
        "seq_length": case.seq_length,
        "tight": case.tight,
        "search_s": round(wall, 3),
        "search_cpu_s": round(cpu, 3),
        "target_s": case.target_s,
        "plan_tokens_per_s": round(plan.prediction.tokens_per_s, 1),
        "uniform_tokens_per_s": round(uni.prediction.tokens_per_s, 1) if uni else 0.0,
        "speedup": round(uniform_s / result.evaluation.iteration_s, 4),
        "bound_speedup": round(uniform_s / bound, 4),
        "speedup_vs_uniform_fsdp": round(fsdp_s / result.evaluation.iteration_s, 4),
        "speedup_vs_uniform_1f1b": round(old_s / result.evaluation.iteration_s, 4),
        "uniform_virtual_stages": uni.virtual_stages if uni else 0,
        "plan_virtual_stages": plan.virtual_stages,
        "plan_mfu": round(plan.prediction.mfu, 4),
        "uniform_mfu": round(uni.prediction.mfu, 4) if uni else 0.0,
        "plan": _describe(plan),
        "uniform": _describe(uni) if uni else "none fits",
        "stats": result.stats,
    }


def _describe(plan) -> str:
    runs = sorted({s.describe() for s in plan.layers})
    stages = ",".join(str(e - s) for s, e in plan.stages)
    vocab = f"{plan.vocab.mode}:{plan.vocab.tp}"
    pp = f"pp{plan.pp}" + (f"x{plan.virtual_stages}v" if plan.virtual_stages > 1 else "")
    return f"{pp} [{stages}] B{plan.micro_batch_size} vocab {vocab}; " + " | ".join(runs)


def summarize(rows: list[dict]) -> dict:
    tight = [r["speedup"] for r in rows if r["tight"]]
    return {
        "min_speedup_vs_uniform": min(r["speedup"] for r in rows),
        "min_speedup_memory_tight": min(tight) if tight else None,
        "search_seconds": {r["case"]: r["search_s"] for r in rows},
        "search_cpu_seconds": {r["case"]: r["search_cpu_s"] for r in rows},
        "search_time_targets_met": {
            r["case"]: r["search_s"] <= r["target_s"] for r in rows if r["target_s"]
        },
    }


def print_table(rows: list[dict]) -> None:
    head = (
        "case",
        "search s",
        "cpu s",
        "uniform tok/s",
        "plan tok/s",
        "speedup",
        "bound",
        "vs +fsdp",
        "vs 1F1B unif",
    )
    lines = [head]
    for r in rows:
        lines.append(
            (
                r["case"] + (" *" if r["tight"] else ""),
                f"{r['search_s']:.2f}",
                f"{r['search_cpu_s']:.2f}",
                f"{r['uniform_tokens_per_s']:,.0f}",
                f"{r['plan_tokens_per_s']:,.0f}",
                f"{r['speedup']:.3f}",
                f"{r['bound_speedup']:.3f}",
                f"{r['speedup_vs_uniform_fsdp']:.3f}",
                f"{r['speedup_vs_uniform_1f1b']:.3f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))
            )
        )
    print("* memory-tight variant")
    for r in rows:
        print(f"{r['case']}:\n  plan    {r['plan']}\n  uniform {r['uniform']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--cases", nargs="*", default=None, help="case keys to run (default all)")
    parser.add_argument("--no-sharded-zero", action="store_true",
                        help="search zero 0/1 only (the space before ZeRO-2/3 ran), to compare")
    parser.add_argument("--moe", action="store_true",
                        help="the MoE suite (search vs the best uniform Megatron MoE layout) and "
                        "the published MoE runs scored by the cost model, instead of the dense "
                        "suite")
    parser.add_argument("--no-interleaving", action="store_true",
                        help="no interleaved schedule in the search or the uniform baseline")
    args = parser.parse_args()
    suite = MOE_SUITE if args.moe else SUITE
    cases = [c for c in suite if args.cases is None or c.key in args.cases]
    rows = []
    for case in cases:
        rows.append(run_case(case, sharded_zero=not args.no_sharded_zero,
                             interleaving=not args.no_interleaving))
        print(f"done {case.key}: {rows[-1]['search_s']:.2f} s", file=sys.stderr)
    print_table(rows)
    published = []
    if args.moe:
        for run in PUBLISHED:
            for rho in (1.0, DEFAULT_MOE_IMBALANCE):
                published.append(run_published(run, rho))
        print("published MoE runs (H100, BF16), predicted tokens/s/GPU by imbalance rho:")
        for p in published:
            print(f"  {p['run']}: rho {p['imbalance']:g}: predicted {p['predicted']:,} vs "
                  f"published {p['published']:,} ({100 * p['error']:+.1f}%), peak "
                  f"{p['peak_gib']} GiB{'' if p['feasible'] else ' (over memory)'}")
    out = {
        "summary": summarize(rows),
        "cases": rows,
        "published_moe": published,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(json.dumps(out["summary"], indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    install_warning_filters()
    sys.exit(main())
