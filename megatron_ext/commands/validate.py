"""`megatron-ext validate PLAN.json`: check a plan file and print its layer table."""

from __future__ import annotations

import argparse
import sys

from megatron_ext.commands.moe_support import moe_summary
from megatron_ext.plan import ParallelPlan


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check a plan file; exit 2 with a one-line error if bad")
    p.add_argument("plan", help="plan JSON file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = ParallelPlan.load(args.plan)
    sys.stderr.write(f"{args.plan}: valid plan for {plan.model.name} on {plan.world_size} ranks\n")
    sys.stderr.write(moe_summary(plan.model))
    for start, end, strategy in plan.layer_runs():
        sys.stderr.write(f"  [{start:>3}, {end:>3})  stage {plan.stage_of_layer(start)}  "
                         f"{strategy.describe()}\n")
    return 0
