"""`megatron-ext flexsp plan`: plan one variable-length global batch with flexible SP groups.

Samples a batch from a built-in length distribution (or reads `--lengths FILE`, integers
separated by whitespace), plans it for a model preset on a cluster preset, and prints to stderr
the cost-model constants, the batch's long tail, the micro-batches with their group shapes, the
planner time and (unless --no-static) the best static Ulysses degree for comparison. `--out`
writes the full plan (every group's rank range and sequence ids) as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from megatron_ext.errors import PlanError
from megatron_ext.presets import cluster_preset, model_preset

if TYPE_CHECKING:
    from megatron_ext.planner.flexsp import FlexSPCostModel

DEFAULT_MODEL = "llama2-7b"
DEFAULT_CLUSTER = "dgx-h100"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flexsp", help="flexible sequence parallelism (FlexSP) tools")
    actions = p.add_subparsers(dest="flexsp_command", required=True,
                               parser_class=type(p))
    plan = actions.add_parser("plan", help="plan one variable-length batch; print the groups")
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--distribution", default="wikipedia",
                        help="wikipedia, wlb_llm_like or github_like (default wikipedia)")
    source.add_argument("--lengths", help="file of sequence lengths (whitespace separated)")
    plan.add_argument("--num-sequences", type=int, default=512, help="batch size (default 512)")
    plan.add_argument("--max-length", type=int, default=131072,
                      help="longest sequence kept; longer draws are redrawn (default 131072)")
    plan.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    plan.add_argument("--model", default=DEFAULT_MODEL, help=f"model preset ({DEFAULT_MODEL})")
    plan.add_argument("--cluster", default=DEFAULT_CLUSTER,
                      help=f"cluster preset ({DEFAULT_CLUSTER})")
    plan.add_argument("--gpus", type=int, default=64, help="devices (default 64)")
    plan.add_argument("--memory-gib", type=float, default=None, help="usable memory per GPU")
    plan.add_argument("--max-degree", type=int, default=0,
                      help="largest group (power of two; default: what the head count allows)")
    plan.add_argument("--no-static", dest="static", action="store_false",
                      help="skip the static-degree comparison")
    plan.add_argument("--out", default=None, help="write the plan JSON here")
    plan.set_defaults(run=run)


def _lengths(args: argparse.Namespace) -> np.ndarray:
    from megatron_ext.planner.flexsp import sample_lengths

    if args.lengths is None:
        return sample_lengths(args.distribution, args.num_sequences, max_length=args.max_length,
                              rng=np.random.default_rng(args.seed))
    try:
        words = Path(args.lengths).read_text(encoding="utf-8").split()
    except (OSError, UnicodeDecodeError) as err:
        raise PlanError(f"cannot read --lengths {args.lengths}: {err}; check the path") from None
    try:
        values = [int(w) for w in words]
    except ValueError:
        raise PlanError(f"--lengths {args.lengths} must hold integers separated by whitespace"
                        ) from None
    if not values or min(values) < 1:
        raise PlanError(f"--lengths {args.lengths} must hold at least one length, all >= 1")
    return np.asarray(values, dtype=np.int64)


def run(args: argparse.Namespace) -> int:
    from megatron_ext.planner.flexsp import cost_model_from_specs, plan_step, tail_stats

    if args.gpus < 1:
        raise PlanError(f"--gpus={args.gpus} must be >= 1")
    model = model_preset(args.model)
    base = cluster_preset(args.cluster, memory_gib=args.memory_gib)
    nodes = -(-args.gpus // base.gpus_per_node)
    cluster = cluster_preset(args.cluster, num_nodes=nodes, memory_gib=args.memory_gib)
    cost = cost_model_from_specs(model, cluster, num_gpus=args.gpus, max_degree=args.max_degree)
    lengths = _lengths(args)
    stats = tail_stats(lengths)
    err = sys.stderr
    err.write(f"flexsp: {model.name} on {args.gpus} x {cluster.name} ({cluster.gpus_per_node}/node"
              f", {cluster.memory_gib:g} GiB): {cost.capacity_tokens} tokens/GPU, degrees "
              f"{'/'.join(map(str, cost.degrees))}, fixed {cost.fixed_s_per_microbatch:.3f} s/mb\n")
    source = args.lengths or f"{args.distribution} (seed {args.seed}, max {args.max_length})"
    err.write(f"batch: {lengths.size} sequences from {source}, {int(stats['tokens'])} tokens, "
              f"longest {int(stats['max_length'])}, {stats['token_share_over_32k']:.1%} of "
              f"tokens and {stats['sq_share_over_32k']:.1%} of sum(s^2) in sequences > 32K\n")
    start = time.process_time()
    plan = plan_step(lengths, cost)
    planner_ms = (time.process_time() - start) * 1e3
    err.write(plan.summary() + f"\nplanner: {planner_ms:.1f} ms CPU\n")
    if args.static:
        _compare_static(lengths, cost, plan.predicted_time_s)
    if args.out:
        Path(args.out).write_text(json.dumps(plan.to_dict()) + "\n", encoding="utf-8")
        err.write(f"wrote {args.out}\n")
    return 0


def _compare_static(lengths: np.ndarray, cost: FlexSPCostModel, flexsp_s: float) -> None:
    from megatron_ext.planner.flexsp import plan_step

    times: dict[int, float] = {}
    need = cost.min_degree_for(int(lengths.max()))
    for degree in cost.degrees:
        if degree >= need and cost.num_gpus % degree == 0:
            times[degree] = plan_step(lengths, cost, fixed_degree=degree).predicted_time_s
    line = "  ".join(f"{d}: {t:.3f} s" for d, t in times.items())
    best = min(times, key=lambda d: times[d])
    sys.stderr.write(f"static Ulysses degree (same micro-batching and assignment): {line}\n"
                     f"flexsp {flexsp_s:.3f} s vs best static (degree {best}) "
                     f"{times[best]:.3f} s: {times[best] / flexsp_s:.2f}x\n")
