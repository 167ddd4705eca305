"""`megatron-ext evaluate PLAN.json`: will this plan fit, and how fast is it, without running it.

Scores a plan with the same cost model the search uses (planner/cost/breakdown.py): per-stage
memory (weights, gradients, optimizer states, activations, vocabulary, transient, reserve),
per-stage time (compute, recomputation, exposed communication, optimizer, bubble), the
bottleneck, tokens/s and MFU. The cluster is the plan's `cluster`, or --cluster/--nodes/
--memory-gib or --cluster-profile as for `search`. --against-search runs the search on the same
model, cluster, batch, sequence and precision and shows both side by side. The report goes to
stderr, --json PATH (or - for stdout) writes it machine-readable. Exit 0 if the plan fits, 3 if
it does not (the report says which stage and by how much), 2 on bad input.
`megatron-ext plan-from-args --evaluate ... -- <flags>` scores the plan a Megatron command line
describes the same way (commands/args.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from megatron_ext.errors import PlanError
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.training import ENGINES
from megatron_ext.presets import CLUSTER_PRESETS, cluster_preset
from megatron_ext.specs import ClusterSpec

if TYPE_CHECKING:
    from megatron_ext.planner.cost.breakdown import Breakdown
    from megatron_ext.planner.cost.compute import ComputeProfile
    from megatron_ext.planner.cost.model import CostModel
    from megatron_ext.planner.profile.profiles import ClusterProfile

GIB = 2**30
EXIT_DOES_NOT_FIT = 3


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="predict a plan's memory per stage, time per stage, bottleneck, tokens/s and MFU",
    )
    p.add_argument("plan", help="plan JSON file (megatron-ext search --out, plan-from-args)")
    add_evaluate_arguments(p)
    p.set_defaults(run=run)


def add_cluster_arguments(p: argparse.ArgumentParser, *, default_cluster: str,
                          default_nodes: str) -> None:
    """What search and evaluate price with: the cluster (preset or profile), a measured model
    profile, nodes, memory per GPU and the MoE load imbalance."""
    cluster = p.add_mutually_exclusive_group()
    cluster.add_argument(
        "--cluster",
        metavar="PRESET",
        help=f"cluster preset: {', '.join(CLUSTER_PRESETS)} (default {default_cluster})",
    )
    cluster.add_argument(
        "--cluster-profile", help="cluster profile JSON (megatron-ext profile hardware)"
    )
    p.add_argument(
        "--model-profile",
        help="model profile JSON (megatron-ext profile model): measured layer times replace "
        "the analytic compute",
    )
    p.add_argument("--nodes", type=int, default=None, help=f"nodes (default {default_nodes})")
    p.add_argument("--memory-gib", type=float, default=None, help="usable memory per GPU")
    p.add_argument(
        "--moe-imbalance", type=float, default=None, metavar="RHO",
        help="MoE models: routed tokens on the busiest rank over the mean (default 1.2, "
        "Switch Transformer's capacity factor; 1 = balanced)",
    )


def add_evaluate_arguments(p: argparse.ArgumentParser) -> None:
    """The cluster and output flags `evaluate` and `plan-from-args --evaluate` share."""
    add_cluster_arguments(p, default_cluster="the plan's cluster",
                          default_nodes="the plan's world size / GPUs per node")
    p.add_argument(
        "--no-flash-attention", dest="flash_attention", action="store_false",
        help="the run keeps the attention scores (no flash / fused attention kernel)",
    )
    p.add_argument(
        "--no-dropout", dest="dropout", action="store_false",
        help="the run has no dropout (--hidden-dropout 0 --attention-dropout 0)",
    )
    p.add_argument(
        "--engine", choices=ENGINES, default="megatron",
        help="what runs the step: megatron (default; its data-parallel traffic overlaps compute "
        "only with --overlap-grad-reduce / --overlap-param-gather); deepspeed "
        "(Megatron-DeepSpeed) reduces after the last backward and caps ZeRO-3's gathered "
        "parameters at 1e9 (stage3_max_live_parameters); deepspeed-bf16: DeepSpeed's "
        "BF16_Optimizer (bf16, config ZeRO stage 0; plan layers zero 1), which all-reduces the "
        "gradients in bf16 instead of reduce-scattering them and keeps a bf16 copy of each",
    )
    p.add_argument(
        "--overlap-grad-reduce", action="store_true",
        help="the run passed Megatron-LM's --overlap-grad-reduce (default off: the gradient "
        "reduction runs after the last backward, on the critical path)",
    )
    p.add_argument(
        "--overlap-param-gather", action="store_true",
        help="the run passed Megatron-LM's --overlap-param-gather (default off: ZeRO-1's weight "
        "all-gather runs after the optimizer step)",
    )
    p.add_argument(
        "--compute-constant", action="append", default=[], metavar="NAME=VALUE",
        help="a kernel constant of the analytic cost model where the run's GPU or kernels are "
        "not what it assumes (a ComputeProfile field, e.g. attention_efficiency=0.35 for "
        "FlashAttention-2 on H100, hbm_bytes_per_s=2.4e12 for HBM2e); repeatable",
    )
    p.add_argument(
        "--megatron-p2p-overlap", action="store_true",
        help="the run is Megatron-LM's interleaved schedule with its default point-to-point "
        "overlap (overlap_p2p_comm; off there only with --no-overlap-p2p-communication): a "
        "pipeline message costs what outlasts the chunk beside it. Default off: messages are on "
        "the critical path, as megatron_ext's runtime sends them",
    )
    p.add_argument(
        "--tp-comm-overlap", action="store_true",
        help="the run passed Megatron-LM's --tp-comm-overlap (Transformer Engine userbuffers; "
        "default off: the sequence-parallel all-gathers and reduce-scatters are on the critical "
        "path); needs layers with tp > 1 and sp",
    )
    p.add_argument(
        "--against-search",
        action="store_true",
        help="also search the fastest layout on the same inputs and show both side by side",
    )
    p.add_argument(
        "--json", default=None, metavar="PATH",
        help="write the evaluation as JSON here (- for stdout)",
    )


def run(args: argparse.Namespace) -> int:
    plan = ParallelPlan.load(args.plan)
    return evaluate_plan(plan, args, label=args.plan)


def evaluate_plan(plan: ParallelPlan, args: argparse.Namespace, *, label: str) -> int:
    """Score `plan` on the cluster the flags (or the plan) give, print and write the report."""
    if plan.flexsp is not None:
        raise PlanError(
            "plan.flexsp is set: evaluate scores layerwise plans; `megatron-ext flexsp` "
            "predicts FlexSP steps"
        )
    cm = _cost_model(plan, args)
    c = cm.cluster
    sys.stderr.write(
        f"evaluate: {label}: {plan.model.name} on {c.num_gpus} x {c.name} GPUs "
        f"({c.num_nodes} node{'s' if c.num_nodes > 1 else ''}, {c.memory_gib:g} GiB), "
        f"global batch {plan.global_batch_size}, seq {plan.seq_length}, {plan.precision}\n"
    )
    if plan.model.moe is not None:  # MFU counts the parameters a token uses
        from megatron_ext.planner.cost.moe import moe_model_parameters

        total, active = (moe_model_parameters(plan.model, active=a) for a in (False, True))
        sys.stderr.write(f"model: {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per "
                         "token (MFU counts the active ones)\n")
    mine = _breakdown(cm, plan)
    sys.stderr.write(report_text(plan, mine, cluster=c.name))
    out: dict[str, Any] = {
        "plan": label,
        "model": plan.model.name,
        "cluster": c.to_dict(),
        "evaluation": report_dict(plan, mine, cluster=c.name),
    }
    if args.against_search:
        from megatron_ext.planner.report import plan_summary
        from megatron_ext.planner.search import search

        # the same model, cluster, batch, sequence and precision; the search's default space
        # (ZeRO-3 too when the plan uses it)
        # searched and priced without --tp-comm-overlap: the search never plans it (the
        # training runtime refuses it), so the searched plan does not carry it
        plain = cm.with_training(dataclasses.replace(cm.training, tp_comm_overlap=False))
        found = search(plain)
        theirs = _breakdown(plain, found.plan)
        sys.stderr.write(f"searched plan (search took {found.search_s:.2f} s):\n")
        sys.stderr.write(report_text(found.plan, theirs, cluster=c.name))
        sys.stderr.write(_side_by_side(plan_summary(plan), mine, plan_summary(found.plan), theirs))
        out["search"] = {**report_dict(found.plan, theirs, cluster=c.name),
                         "plan": found.plan.to_dict()}
    if args.json == "-":
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=2)
        sys.stderr.write(f"wrote {args.json}\n")
    return 0 if mine.evaluation.feasible else EXIT_DOES_NOT_FIT


def _cluster(plan: ParallelPlan, args: argparse.Namespace
             ) -> tuple[ClusterSpec, ClusterProfile | None]:
    """(cluster, measured profile or None): --cluster-profile, --cluster, else the plan's."""
    if args.nodes is not None and args.nodes < 1:
        raise PlanError(f"--nodes={args.nodes} must be >= 1")
    if args.memory_gib is not None and not args.memory_gib > 0:
        raise PlanError(f"--memory-gib={args.memory_gib} must be > 0")
    profile: ClusterProfile | None = None
    if args.cluster_profile:
        from megatron_ext.planner.profile.profiles import ClusterProfile

        profile = ClusterProfile.load(args.cluster_profile)
        base, source = profile.cluster, f"--cluster-profile {args.cluster_profile}"
    elif args.cluster:
        base, source = cluster_preset(args.cluster), f"--cluster {args.cluster}"
    elif plan.cluster is not None:
        base, source = plan.cluster, "the plan's cluster"
    else:
        raise PlanError(
            "the plan has no cluster; pass --cluster PRESET (with --nodes N) or "
            "--cluster-profile FILE"
        )
    nodes = args.nodes
    if nodes is None:
        if plan.world_size % base.gpus_per_node:
            raise PlanError(
                f"world_size={plan.world_size} is not a whole number of {source}'s nodes of "
                f"{base.gpus_per_node} GPUs; pass a cluster with a matching node size"
            )
        nodes = plan.world_size // base.gpus_per_node
    cluster = dataclasses.replace(base, num_nodes=nodes)
    if args.memory_gib is not None:
        cluster = dataclasses.replace(cluster, memory_gib=args.memory_gib)
    if cluster.num_gpus != plan.world_size:
        raise PlanError(
            f"--nodes={nodes} x {cluster.gpus_per_node} GPUs = {cluster.num_gpus} but the plan "
            f"has world_size={plan.world_size}; pass --nodes "
            f"{plan.world_size // cluster.gpus_per_node or 1} or re-plan"
        )
    return cluster, profile


def _cost_model(plan: ParallelPlan, args: argparse.Namespace) -> CostModel:
    from megatron_ext.planner.cost.evaluate import plan_training
    from megatron_ext.planner.cost.model import CostModel

    cluster, profile = _cluster(plan, args)
    training = plan_training(plan, flash_attention=args.flash_attention, dropout=args.dropout,
                             engine=args.engine, moe_imbalance=args.moe_imbalance,
                             overlap_grad_reduce=args.overlap_grad_reduce,
                             overlap_param_gather=args.overlap_param_gather,
                             tp_comm_overlap=args.tp_comm_overlap,
                             overlap_p2p_comm=args.megatron_p2p_overlap)
    compute = compute_constants(args.compute_constant)
    if compute is not None and args.model_profile:
        raise PlanError("--compute-constant sets the analytic kernel constants and "
                        "--model-profile replaces them with measured ones; pass one of them")
    if profile is None and not args.model_profile:
        return CostModel(plan.model, cluster, training, compute=compute)
    from megatron_ext.planner.profile.cost import ProfiledCostModel
    from megatron_ext.planner.profile.profiles import ModelProfile

    model_profile = ModelProfile.load(args.model_profile) if args.model_profile else None
    return ProfiledCostModel(
        plan.model, cluster, training, comm=profile, model_profile=model_profile, compute=compute
    )


def compute_constants(items: list[str]) -> ComputeProfile | None:
    """--compute-constant NAME=VALUE ... as the cost model's kernel constants (the defaults for
    the rest); None when none is given."""
    from megatron_ext.planner.cost.compute import ComputeProfile

    if not items:
        return None
    values: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition("=")  # no "=": value "" fails float() too
        try:
            values[name.strip()] = float(value)
        except ValueError:
            raise PlanError(f"--compute-constant {item!r} is not NAME=NUMBER; e.g. "
                            "--compute-constant attention_efficiency=0.35") from None
    return ComputeProfile.from_dict(values, "--compute-constant")


def _breakdown(cm: CostModel, plan: ParallelPlan) -> Breakdown:
    from megatron_ext.planner.cost.breakdown import breakdown

    return breakdown(cm, plan.layout)


def _interval(plan: ParallelPlan, b: Breakdown, cluster: str
              ) -> tuple[float, float, tuple[str, ...]]:
    """90% interval of the evaluated iteration time (planner/cost/interval.py)."""
    from megatron_ext.planner.cost.interval import plan_interval

    return plan_interval(plan, b.evaluation.iteration_s, cluster)


def report_dict(plan: ParallelPlan, b: Breakdown, *, cluster: str = "custom") -> dict[str, Any]:
    """The machine-readable evaluation of one plan (GiB and seconds)."""
    ev = b.evaluation
    low, high, unseen = _interval(plan, b, cluster)
    return {
        "prediction": {
            "iteration_time_s": ev.iteration_s,
            "iteration_time_interval_s": [low, high],
            "interval_unseen_features": list(unseen),
        },
        "pp": plan.pp,
        "micro_batch_size": plan.micro_batch_size,
        "vocab": {"mode": plan.vocab.mode, "tp": plan.vocab.tp},
        "iteration_s": ev.iteration_s,
        "tokens_per_s": ev.tokens_per_s,
        "mfu": ev.mfu,
        "fits": ev.feasible,
        "memory_cap_gib": b.memory_cap_bytes / GIB,
        "bottleneck_stage": b.bottleneck_stage,
        "bottleneck": b.bottleneck,
        "stages": [
            {
                "stage": k,
                "layers": list(s.layers),
                **({"chunks": [list(c) for c in s.chunks]} if s.chunks else {}),
                "memory_gib": {
                    **{name: v / GIB for name, v in s.memory_bytes.items()},
                    "reserve": s.reserve_bytes / GIB,
                },
                "peak_gib": s.peak_bytes / GIB,
                "time_s": dict(s.time_s),
                "slot_s": s.slot_s,
            }
            for k, s in enumerate(b.stages)
        ],
    }


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]


def _gib(x: float, unit: float = GIB) -> str:
    return f"{x / unit:.2f}"


def _unit(*breakdowns: Breakdown) -> tuple[float, str]:
    """GiB, or MiB when every stage holds less than 1 GiB (the CPU-sized models)."""
    peak = max(s.peak_bytes for b in breakdowns for s in b.stages)
    return (GIB, "GiB") if peak >= GIB else (2**20, "MiB")


def report_text(plan: ParallelPlan, b: Breakdown, *, cluster: str = "custom") -> str:
    from megatron_ext.planner.cost.breakdown import MEMORY_PARTS

    ev = b.evaluation
    unit, label = _unit(b)
    mem_rows: list[tuple[str, ...]] = [
        (f"memory/GPU {label}", "weights", "grads", "optim", "activ", "vocab", "trans", "reserve",
         "peak", "of cap")
    ]
    time_rows = [
        ("time/iteration s", "compute", "recomp", "exp.comm", "optim", "bubble", "slot/mb")
    ]
    for k, s in enumerate(b.stages):
        name = f"stage {k} {s.label}"
        m = s.memory_bytes
        mem_rows.append(
            (name, *(_gib(m[part], unit) for part in MEMORY_PARTS),
             _gib(s.reserve_bytes, unit), _gib(s.peak_bytes, unit),
             _gib(b.memory_cap_bytes, unit))
        )
        t = s.time_s
        time_rows.append(
            (name, f"{t['compute']:.3f}", f"{t['recompute']:.3f}", f"{t['exposed_comm']:.3f}",
             f"{t['optimizer']:.3f}", f"{t['bubble']:.3f}", f"{s.slot_s:.4f}")
        )
    lines = _table(mem_rows) + _table(time_rows)
    strategies = sorted({s.describe() for s in plan.layers})
    lines.append(
        f"layout: pp={plan.pp}"
        + (f" x {plan.virtual_stages} virtual stages" if plan.virtual_stages > 1 else "")
        + f", micro-batch {plan.micro_batch_size} x "
        f"{plan.global_batch_size // plan.micro_batch_size}, vocabulary "
        f"{'parallel ' if plan.vocab.mode == 'vocab_parallel' else ''}tp={plan.vocab.tp}; "
        f"layers: {' | '.join(strategies)}"
    )
    fits = "fits" if ev.feasible else "DOES NOT FIT"
    free = min(b.memory_cap_bytes - s.peak_bytes for s in b.stages)
    low, high, unseen = _interval(plan, b, cluster)
    lines.append(
        f"predicted: iteration {ev.iteration_s:.3f} s (90% interval {low:.3f} - {high:.3f} s"
        + (f"; no published run with {', '.join(unseen)}: the widest interval" if unseen else "")
        + f"), {ev.tokens_per_s:,.0f} tokens/s, "
        f"MFU {100 * ev.mfu:.1f}%; {fits} "
        + (f"({free / unit:.2f} {label} left on the fullest stage)" if ev.feasible
           else f"({-free / unit:.2f} {label} over on the fullest stage)")
    )
    lines.append(f"bottleneck: {b.bottleneck}")
    return "\n".join(lines) + "\n"


def _side_by_side(mine_summary: dict[str, str], mine: Breakdown,
                  theirs_summary: dict[str, str], theirs: Breakdown) -> str:
    unit, label = _unit(mine, theirs)
    rows = [("", "plan", "searched")]
    rows += [(k, mine_summary[k], theirs_summary[k]) for k in mine_summary if k != "peak GiB"]
    a, b = mine.evaluation, theirs.evaluation
    rows += [
        ("iteration s", f"{a.iteration_s:.3f}", f"{b.iteration_s:.3f}"),
        ("tokens/s", f"{a.tokens_per_s:,.0f}", f"{b.tokens_per_s:,.0f}"),
        ("MFU %", f"{100 * a.mfu:.1f}", f"{100 * b.mfu:.1f}"),
        ("fits", str(a.feasible), str(b.feasible)),
        (f"peak {label}", _gib(max(s.peak_bytes for s in mine.stages), unit),
         _gib(max(s.peak_bytes for s in theirs.stages), unit)),
    ]
    speed = a.iteration_s / b.iteration_s
    lines = ["plan vs searched:"] + ["  " + line for line in _table(rows)]
    lines.append(f"  the searched plan is {speed:.3f}x the plan's speed")
    return "\n".join(lines) + "\n"
