"""`megatron-ext search`: find the fastest layout that fits, write the plan, print Megatron flags.

With no arguments it runs the built-in default case (llama2-7b on one dgx-h100 node, global
batch 512, seq 4096). The stage/layer table and the prediction go to stderr, the Megatron-LM
arguments (one token per line, as `megatron-ext args`) to stdout, the plan to --out.
Exit 3 with the smallest memory per GPU or GPU count that would fit when nothing does.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_ext.commands.evaluate import add_cluster_arguments
from megatron_ext.errors import PlanError
from megatron_ext.flags.emit import plan_to_megatron_args
from megatron_ext.flags.fp8 import add_fp8_args, fp8_from_args
from megatron_ext.planner.cost.compute import model_parameters
from megatron_ext.planner.cost.moe import moe_model_parameters
from megatron_ext.presets import (
    MODEL_PRESETS,
    cluster_preset,
    model_file_with_notes,
    model_preset,
)
from megatron_ext.specs import FP8Spec, ModelSpec

if TYPE_CHECKING:
    from megatron_ext.plan import ParallelPlan
    from megatron_ext.planner.cost.model import CostModel

DEFAULT_MODEL = "llama2-7b"
DEFAULT_CLUSTER = "dgx-h100"
DEFAULT_GLOBAL_BATCH = 512
DEFAULT_SEQ = 4096


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("search", help="search the fastest parallel layout that fits; write a plan")
    model = p.add_mutually_exclusive_group()
    model.add_argument(
        "--model",
        metavar="PRESET",
        help=f"model preset: {', '.join(MODEL_PRESETS)} (default {DEFAULT_MODEL})",
    )
    model.add_argument(
        "--model-config",
        help="HuggingFace config.json, ModelSpec JSON, or a file of Megatron-LM model flags",
    )
    add_cluster_arguments(p, default_cluster=DEFAULT_CLUSTER,
                          default_nodes="1, or the profile's")
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=DEFAULT_GLOBAL_BATCH,
        help="samples per optimizer step (default %(default)s)",
    )
    p.add_argument(
        "--seq-length",
        type=int,
        default=DEFAULT_SEQ,
        help="tokens per sample (default %(default)s)",
    )
    p.add_argument(
        "--precision",
        choices=("bf16", "fp16", "fp32"),
        default="bf16",
        help="(default %(default)s)",
    )
    vocab = p.add_mutually_exclusive_group()
    vocab.add_argument(
        "--allow-vocab-parallel",
        dest="vocab_parallel",
        action="store_true",
        default=True,
        help="may use vocabulary parallelism (default)",
    )
    vocab.add_argument(
        "--no-vocab-parallel",
        dest="vocab_parallel",
        action="store_false",
        help="keep the vocabulary layers on the first/last stage",
    )
    p.add_argument(
        "--no-interleaving",
        dest="interleaving",
        action="store_false",
        help="leave Megatron's interleaved pipeline schedule (virtual stages) out of the search "
        "and the uniform baseline",
    )
    p.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="plan for a run without --overlap-grad-reduce / --overlap-param-gather "
        "(Megatron-LM's defaults): the data-parallel gradient reduction and ZeRO-1's weight "
        "all-gather on the critical path. Default: both on (param gather where the plan has a "
        "distributed optimizer), priced and printed with the plan's flags",
    )
    p.add_argument(
        "--uniform",
        action="store_true",
        help="search only what stock Megatron-LM expresses (same strategy every layer)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="print the best uniform layout beside the plan and why they differ",
    )
    p.add_argument(
        "--objective",
        choices=("time", "p90"),
        default="time",
        help="time: the fastest predicted iteration (default); p90: the lowest upper end of "
        "the 90%% prediction interval (the plan least likely to be slow)",
    )
    add_fp8_args(p)
    p.add_argument("--fp8-bf16-layers", type=_layer_list, default=(), metavar="I,J,...",
                   help="with --fp8-format: also keep these layers (global, zero-based) in bf16 "
                   "(a per-layer choice the layerwise runtime runs; the search never changes "
                   "which layers are FP8)")
    p.add_argument("--plot", default=None, help="draw strategies and stage bars to this PNG")
    p.add_argument("--out", default=None, help="write the plan JSON here")
    p.set_defaults(run=run)


def _model(args: argparse.Namespace) -> ModelSpec:
    if args.model_config is None:
        return model_preset(args.model or DEFAULT_MODEL)
    path = Path(args.model_config)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise PlanError(f"cannot read --model-config {path}: {err}; check the path") from None
    if text.lstrip().startswith("{"):
        model, notes = model_file_with_notes(path)
        if notes:  # field: reason; the fields on one line, the reasons are in hf_config/fields.py
            fields = ", ".join(note.split(":", 1)[0] for note in notes)
            sys.stderr.write(f"--model-config {path.name}: read, not part of the model's shape: "
                             f"{fields}\n")
        return model
    from megatron_ext.flags.parser import parse_megatron_args
    from megatron_ext.flags.to_plan import model_from_args

    tokens = shlex.split(text, comments=True)
    model = model_from_args(parse_megatron_args(tokens, model_only=True))
    return dataclasses.replace(model, name=path.stem)


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer "
                                         "indices, e.g. 0,1,31") from None


def _fp8(args: argparse.Namespace) -> FP8Spec | None:
    fp8 = fp8_from_args(args)
    if args.fp8_bf16_layers:
        if fp8 is None:
            raise PlanError("--fp8-bf16-layers needs --fp8-format (it keeps layers of an FP8 run "
                            "in bf16)")
        fp8 = dataclasses.replace(fp8, bf16_layers=args.fp8_bf16_layers)
    return fp8


def _nodes(args: argparse.Namespace) -> int:
    """--nodes, 1 when omitted; 0 or less is refused by cluster_preset (never read as 1)."""
    return 1 if args.nodes is None else args.nodes


def _cost_model(args: argparse.Namespace, model: ModelSpec) -> CostModel:
    from megatron_ext.plan_checks import check_sequence
    from megatron_ext.planner.cost.model import CostModel
    from megatron_ext.planner.training import TrainingSpec

    check_sequence(args.seq_length, model.max_position_embeddings, seq_name="--seq-length")
    training = TrainingSpec(
        global_batch_size=args.global_batch_size,
        seq_length=args.seq_length,
        precision=args.precision,
        allow_vocab_parallel=args.vocab_parallel,
        **({} if args.moe_imbalance is None else {"moe_imbalance": args.moe_imbalance}),
        allow_interleaving=args.interleaving,
        fp8=_fp8(args),
        overlap_grad_reduce=args.overlap,
        overlap_param_gather=args.overlap,
    )
    if not args.cluster_profile and not args.model_profile:
        cluster = cluster_preset(
            args.cluster or DEFAULT_CLUSTER, num_nodes=_nodes(args), memory_gib=args.memory_gib
        )
        return CostModel(model, cluster, training)
    from megatron_ext.planner.profile.cost import ProfiledCostModel
    from megatron_ext.planner.profile.profiles import ClusterProfile, ModelProfile

    profile = ClusterProfile.load(args.cluster_profile) if args.cluster_profile else None
    if profile is not None:
        cluster = profile.cluster
        if args.nodes is not None:
            if args.nodes < 1:
                raise PlanError(f"--nodes={args.nodes} must be >= 1")
            cluster = dataclasses.replace(cluster, num_nodes=args.nodes)
        if args.memory_gib is not None:
            if not args.memory_gib > 0:
                raise PlanError(f"--memory-gib={args.memory_gib} must be > 0")
            cluster = dataclasses.replace(cluster, memory_gib=args.memory_gib)
    else:
        cluster = cluster_preset(
            args.cluster or DEFAULT_CLUSTER, num_nodes=_nodes(args), memory_gib=args.memory_gib
        )
    model_profile = ModelProfile.load(args.model_profile) if args.model_profile else None
    return ProfiledCostModel(model, cluster, training, comm=profile, model_profile=model_profile)


class _Progress:
    """Progress lines on stderr, only once the search has run for a second, at most one a second."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def __call__(self, message: str) -> None:
        now = time.perf_counter()
        if now - self.start >= 1.0 and now - self.last >= 1.0:
            sys.stderr.write(f"search [{now - self.start:5.1f} s] {message}\n")
            self.last = now


def run(args: argparse.Namespace) -> int:
    from megatron_ext.planner.report import (
        check_plot_support,
        explain,
        overlap_note,
        plan_table,
        plot_plan,
    )
    from megatron_ext.planner.search import SearchOptions, search

    if args.plot:  # before the search and --out: a missing matplotlib costs nothing
        check_plot_support()
    model = _model(args)
    cm = _cost_model(args, model)
    c = cm.cluster
    nodes = f"{c.num_nodes} node{'s' if c.num_nodes != 1 else ''}"
    sys.stderr.write(
        f"model: {model.name}, {_billions(model_parameters(model))} parameters "
        + (f"({_billions(moe_model_parameters(model, active=True))} active per token) "
           if model.moe is not None else "")
        + f"({model.num_layers} layers, hidden {model.hidden_size}"
        + (f"; its name says {stated}" if (stated := _stated_size(model.name)) else "")
        + ")\n"
    )
    sys.stderr.write(
        f"search: {model.name} on {c.num_gpus} x {c.name} GPUs ({nodes}, "
        f"{c.memory_gib:g} GiB), global batch {args.global_batch_size}, "
        f"seq {args.seq_length}, {args.precision}"
        + (", uniform layouts only" if args.uniform else "")
        + (", objective: upper end of the 90% interval" if args.objective == "p90" else "")
        + "\n"
    )
    result = search(
        cm, options=SearchOptions(uniform_only=args.uniform, objective=args.objective),
        progress=_Progress(),
    )
    plan = result.plan
    sys.stderr.write(f"search took {result.search_s:.2f} s\n")
    sys.stderr.write(plan_table(plan))
    sys.stderr.write(overlap_note(plan, args.objective))
    if args.explain:
        sys.stderr.write(
            explain(plan, result.evaluation, result.uniform_plan, result.uniform_evaluation)
        )
    if args.out:
        plan.save(args.out)
        sys.stderr.write(f"wrote {args.out}\n")
    if args.plot:
        plot_plan(plan, args.plot)
        sys.stderr.write(f"wrote {args.plot}\n")
    _print_megatron_args(plan, args.out)
    return 0


def _billions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"


def _stated_size(name: str) -> str | None:
    """The size a model's name states ("Llama-2-7b-hf" -> 7B); None for none or several, or a
    mixture-of-experts "8x7B" (the name gives the expert size, not the total); an "A2.7B"
    (Qwen-MoE's activated parameters) is not the total either."""
    sizes = re.findall(r"(?<![\dx.A])(\d+(?:\.\d+)?)([bBmM])(?![a-zA-Z])", name)
    if len(sizes) != 1:
        return None
    number, unit = sizes[0]
    return f"{number}{unit.upper()}"


def _print_megatron_args(plan: ParallelPlan, plan_path: str | None) -> None:
    try:
        result = plan_to_megatron_args(plan, plan_path=plan_path)
    except PlanError as err:
        reason = str(err)
        if plan_path is None and not plan.is_uniform():
            reason = (
                "this layerwise plan is run through --strategy-config PLAN.json; "
                "add --out PLAN.json to print the arguments"
            )
        sys.stderr.write(f"note: no Megatron-LM arguments printed: {reason}\n")
        return
    if result.needs_megatron_ext:
        sys.stderr.write(
            "note: this plan needs megatron_ext's pretrain_gpt.py: "
            f"{'; '.join(result.needs_megatron_ext)}\n"
        )
    sys.stdout.write("".join(token + "\n" for token in result.argv))
