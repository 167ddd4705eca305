"""`megatron-ext args PLAN.json` and `megatron-ext plan-from-args -- <Megatron flags>`.

`args` prints Megatron-LM flags one argv token per line, so
`mapfile -t ARGS < <(megatron-ext args plan.json)` keeps layout strings such as `Et*3|tL`
intact; a note on stderr says when the plan needs megatron_ext's pretrain_gpt.py.
`plan-from-args` builds the plan a Megatron command line describes (JSON on stdout or --out,
the layer table on stderr), so a hand-written configuration can be compared with a searched one.
`flags [FLAG ...]` (num-experts, or `-- --num-experts`) prints the flag table
(flags/catalog.py): each Megatron-LM flag's class (honoured, no effect here, refused) and why;
with no FLAG, the count per class.
All three take `--megatron-version V` (0.16.1, 0.19, 0.19.2, ...): the Megatron-LM flag catalog to
emit or read (flags/versions.py); by default the installed megatron-core's, else the newest
catalog. A flag the chosen version lacks is refused in one line naming the version and what
replaces it there.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_ext.commands.evaluate import add_evaluate_arguments, evaluate_plan
from megatron_ext.commands.moe_support import moe_summary
from megatron_ext.errors import PlanError
from megatron_ext.flags.emit import plan_to_megatron_args
from megatron_ext.flags.parser import (
    parse_megatron_args,
    plan_from_megatron_args,
)
from megatron_ext.flags.versions import CATALOGS
from megatron_ext.plan import ParallelPlan


def add_version_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--megatron-version", default=None, metavar="VERSION",
        help="Megatron-LM / megatron-core version whose flags to use: "
        f"{', '.join(c.version for c in CATALOGS)} (or any patch release of those); default: the "
        "installed megatron-core's, else the newest")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "args", aliases=["emit-args"],
        help="print the Megatron-LM flags of a plan, one argv token per line",
    )
    p.add_argument("plan", help="plan JSON file")
    p.add_argument("--plan-path", default=None,
                   help="path to print after --strategy-config when the plan needs it, e.g. "
                   "where the file sits inside the training container (default: PLAN as given)")
    add_version_argument(p)
    p.set_defaults(run=run_args)
    q = sub.add_parser(
        "plan-from-args",
        help="build the plan of a Megatron-LM command line: plan-from-args [--world-size N] "
        "[--out plan.json] -- <megatron flags>",
    )
    q.add_argument("--world-size", type=int, default=None,
                   help="ranks of the job (default: $WORLD_SIZE, else tp*pp*cp, i.e. dp=1)")
    q.add_argument("--out", default=None, help="write the plan here instead of stdout")
    q.add_argument("--evaluate", action="store_true",
                   help="also predict the plan's memory and time per stage (as megatron-ext "
                   "evaluate; the cluster from --cluster/--nodes or --cluster-profile)")
    add_evaluate_arguments(q)
    add_version_argument(q)
    q.add_argument("megatron_args", nargs=argparse.REMAINDER,
                   help="Megatron-LM pretrain_gpt.py flags, after --")
    q.set_defaults(run=run_plan_from_args)
    f = sub.add_parser(
        "flags",
        help="how megatron_ext treats Megatron-LM flags: flags [FLAG ...] [--class CLASS]",
    )
    f.add_argument("flag_names", nargs="*", metavar="FLAG",
                   help="a flag without its dashes (num-experts), or after --")
    f.add_argument("--class", dest="kind", choices=["honoured", "no_effect", "refused"],
                   default=None, help="list every flag of this class")
    add_version_argument(f)
    f.set_defaults(run=run_flags)


def run_flags(args: argparse.Namespace) -> int:
    from megatron_ext.flags.catalog import PLANNER_ONLY, class_sizes, option_sets, runtime_refusal
    from megatron_ext.flags.parser import check_version_flags, flag_catalog
    from megatron_ext.flags.versions import resolve

    version = resolve(args.megatron_version)
    table = flag_catalog(version)
    if not args.flag_names and args.kind is None:
        sizes = class_sizes(table)
        sys.stdout.write(f"{len(table)} Megatron-LM {version.tag} flags: "
                         + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in sizes.items())
                         + "\n")
        return 0
    args.flag_names = [n if n.startswith("-") else f"--{n}" for n in args.flag_names]
    check_version_flags(args.flag_names, version)
    for name in args.flag_names:
        if name not in table:
            known = any(name in options for options in option_sets().values())
            raise PlanError(f"{name} is not a Megatron-LM {version.tag} flag"
                            + ("" if known else "; check the spelling"))
    names = args.flag_names or [o for o, e in table.items() if e.kind == args.kind]
    for name in names:
        entry = table[name]
        if entry.kind == "honoured" and name in PLANNER_ONLY:
            line = (f"{name}: honoured by plan-from-args, evaluate, args and validate (priced "
                    "by the cost model); pretrain_gpt.py refuses it: "
                    + runtime_refusal(name))
        elif entry.kind == "honoured":
            line = f"{name}: honoured (same name, meaning and default as Megatron-LM)"
        elif entry.kind == "no_effect":
            line = entry.note()
        else:
            line = f"{name}: refused unless given its default; {entry.reason}; {entry.instead}"
        sys.stdout.write(line + "\n")
    return 0


def run_args(args: argparse.Namespace) -> int:
    plan = ParallelPlan.load(args.plan)
    result = plan_to_megatron_args(plan, plan_path=args.plan_path or args.plan,
                                   megatron_version=args.megatron_version)
    if result.needs_megatron_ext:
        sys.stderr.write(
            "megatron-ext: note: this plan needs megatron_ext's pretrain_gpt.py (stock "
            f"Megatron-LM cannot run it): {'; '.join(result.needs_megatron_ext)}\n"
        )
    sys.stdout.write("".join(token + "\n" for token in result.argv))
    return 0


def run_plan_from_args(args: argparse.Namespace) -> int:
    argv = list(args.megatron_args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise PlanError("no Megatron flags given; use plan-from-args [--world-size N] -- <flags>")
    _check_evaluate_flags(args)
    world_size = _world_size(args.world_size)
    ns = parse_megatron_args(argv, world_size=world_size, megatron_version=args.megatron_version)
    if world_size is None:
        world_size = (ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size
                      * ns.context_parallel_size)
        sys.stderr.write(f"megatron-ext: note: assuming world size {world_size} (data-parallel "
                         "size 1); pass --world-size N\n")
        ns = parse_megatron_args(argv, world_size=world_size,
                                 megatron_version=args.megatron_version)
    plan = plan_from_megatron_args(ns, world_size)
    # the Megatron flags say how the run overlaps its data-parallel traffic too
    args.overlap_grad_reduce = args.overlap_grad_reduce or ns.overlap_grad_reduce
    args.overlap_param_gather = args.overlap_param_gather or ns.overlap_param_gather
    args.tp_comm_overlap = args.tp_comm_overlap or ns.tp_comm_overlap
    # Megatron-LM overlaps the interleaved schedule's messages unless told not to
    args.megatron_p2p_overlap = args.megatron_p2p_overlap or (
        plan.virtual_stages > 1 and bool(getattr(ns, "overlap_p2p_comm", True)))
    if args.out:
        plan.save(args.out)
    else:
        sys.stdout.write(plan.to_json())
    sys.stderr.write(f"plan for {plan.model.name} on {plan.world_size} ranks, pp={plan.pp}, "
                     f"micro_batch_size={plan.micro_batch_size} (all replicas), "
                     f"global_batch_size={plan.global_batch_size}\n")
    sys.stderr.write(moe_summary(plan.model))
    for start, end, strategy in plan.layer_runs():
        sys.stderr.write(f"  [{start:>3}, {end:>3})  stage {plan.stage_of_layer(start)}  "
                         f"{strategy.describe()}\n")
    if args.evaluate:
        return evaluate_plan(plan, args, label=args.out or "plan from the Megatron flags")
    return 0


EVALUATE_FLAGS = ("cluster", "cluster_profile", "model_profile", "nodes", "memory_gib",
                  "against_search", "json")
EVALUATE_SETTINGS = {"flash_attention": ("--no-flash-attention", True),
                     "dropout": ("--no-dropout", True), "engine": ("--engine", "megatron"),
                     "overlap_grad_reduce": ("--overlap-grad-reduce", False),
                     "overlap_param_gather": ("--overlap-param-gather", False),
                     "tp_comm_overlap": ("--tp-comm-overlap", False),
                     "megatron_p2p_overlap": ("--megatron-p2p-overlap", False),
                     "compute_constant": ("--compute-constant", [])}
"""Evaluate options with a default: dest -> (flag, default)."""


def _check_evaluate_flags(args: argparse.Namespace) -> None:
    """The evaluate flags mean something only with --evaluate; --json - needs stdout free."""
    given = ["--" + name.replace("_", "-") for name in EVALUATE_FLAGS
             if getattr(args, name) not in (None, False)]
    given += [flag for name, (flag, default) in EVALUATE_SETTINGS.items()
              if getattr(args, name) != default]
    if given and not args.evaluate:
        flag = given[0]
        raise PlanError(f"{flag} is an option of --evaluate; add --evaluate or drop {flag}")
    if args.evaluate and args.json == "-" and not args.out:
        raise PlanError("--json - and the plan would both go to stdout; add --out PLAN.json or "
                        "give --json a path")


def _world_size(given: int | None) -> int | None:
    if given is not None:
        if given < 1:
            raise PlanError(f"--world-size={given} must be >= 1")
        return given
    env = os.environ.get("WORLD_SIZE")
    if env is None:
        return None
    if not env.isdigit() or int(env) < 1:
        raise PlanError(f"$WORLD_SIZE={env!r} is not a positive integer; pass --world-size N")
    return int(env)
