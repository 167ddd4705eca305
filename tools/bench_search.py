"""Benchmark of `megatron-ext search`: search time and predicted speedup over the best uniform
(stock Megatron-LM) layout on a fixed suite, printed as a table and written as JSON.

    python tools/bench_search.py [--json bench_search.json] [--cases NAME ...]

Speedup = plan tokens/s / best uniform tokens/s, both predicted by the same cost model.
`bound` = uniform time / the search's own lower bound on any layout's time (the relaxation the
search prunes with): no layout in the cost model can beat the uniform one by more than that.
`vs +fsdp` = speedup over a wider uniform baseline that may also use Megatron-LM's FSDP2
(ZeRO-3 on every layer, pp=1 only), which the issue's baseline leaves out.
Search time is wall-clock (and CPU time) of one `search` call in this process; on a shared
machine the CPU time is the fairer number.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass

from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.search import _combos, search
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.planner.uniform import search_uniform
from megatron_ext.presets import cluster_preset, model_preset


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One benchmark case."""

    model: str
    """Model preset."""
    cluster: str
    """Cluster preset."""
    nodes: int
    """Nodes of 8 GPUs."""
    global_batch_size: int
    """Samples per step."""
    seq_length: int
    """Tokens per sample."""
    memory_gib: float | None = None
    """Override of the preset's memory per GPU."""
    tight: bool = False
    """Counts towards min_speedup_memory_tight."""
    target_s: float | None = None
    """Search-time target of the issue."""

    @property
    def key(self) -> str:
        gpus = self.nodes * 8
        return f"{self.model}@{gpus}" + (f"@{self.memory_gib:g}GiB" if self.memory_gib else "")


SUITE = (
    Case(
        model="llama2-7b",
        cluster="dgx-h100",
        nodes=1,
        global_batch_size=512,
        seq_length=4096,
        target_s=1.0,
    ),
    Case(
        model="llama2-13b",
        cluster="dgx-a100-40g",
        nodes=2,
        global_batch_size=512,
        seq_length=4096,
        tight=True,
    ),
    Case(
        model="llama3-70b",
        cluster="dgx-h100",
        nodes=8,
        global_batch_size=1024,
        seq_length=8192,
        target_s=10.0,
    ),
    Case(
        model="gpt3-175b",
        cluster="dgx-a100-80g",
        nodes=128,
        global_batch_size=1536,
        seq_length=2048,
    ),
    Case(
        model="llama3-405b",
        cluster="dgx-h100",
        nodes=512,
        global_batch_size=2048,
        seq_length=8192,
    ),
    Case(
        model="llama3-405b",
        cluster="dgx-h100",
        nodes=1024,
        global_batch_size=2048,
        seq_length=8192,
        target_s=10.0,
    ),
    # memory-tight variants
    Case(
        model="llama2-7b",
        cluster="dgx-h100",
        nodes=1,
        global_batch_size=512,
        seq_length=4096,
        memory_gib=24,
        tight=True,
    ),
    Case(
        model="llama3-8b",
        cluster="dgx-h100",
        nodes=1,
        global_batch_size=512,
        seq_length=8192,
        memory_gib=24,
        tight=True,
    ),
    Case(
        model="llama3-70b",
        cluster="dgx-h100",
        nodes=8,
        global_batch_size=1024,
        seq_length=8192,
        memory_gib=40,
        tight=True,
    ),
    Case(
        model="gpt3-175b",
        cluster="dgx-a100-40g",
        nodes=128,
        global_batch_size=1536,
        seq_length=2048,
        memory_gib=40,
        tight=True,
    ),
)


def run_case(case: Case, sharded_zero: bool = True) -> dict:
    cluster = cluster_preset(case.cluster, num_nodes=case.nodes, memory_gib=case.memory_gib)
    training = TrainingSpec(global_batch_size=case.global_batch_size, seq_length=case.seq_length,
                            allow_zero3=sharded_zero)
    cm = CostModel(model_preset(case.model), cluster, training)
    wall, cpu = time.perf_counter(), time.process_time()
    result = search(cm)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    plan, uni = result.plan, result.uniform_plan
    bound = min(c.bound_s for c in _combos(cm))
    uniform_s = result.uniform_evaluation.iteration_s if uni else math.inf
    fsdp = search_uniform(cm, fsdp=True)
    fsdp_s = fsdp[1].iteration_s if fsdp else math.inf
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
    return f"pp{plan.pp} [{stages}] B{plan.micro_batch_size} vocab {vocab}; " + " | ".join(runs)


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
    args = parser.parse_args()
    cases = [c for c in SUITE if args.cases is None or c.key in args.cases]
    rows = []
    for case in cases:
        rows.append(run_case(case, sharded_zero=not args.no_sharded_zero))
        print(f"done {case.key}: {rows[-1]['search_s']:.2f} s", file=sys.stderr)
    print_table(rows)
    out = {
        "summary": summarize(rows),
        "cases": rows,
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
    sys.exit(main())
