"""The `megatron-ext` console script: argparse dispatch to megatron_ext.commands.* modules.

Each command module exposes `add_parser(subparsers)` (registering its subcommand with
`set_defaults(run=...)`) and a `run(args) -> int`. Machine-readable output goes to stdout or
--out, human summaries to stderr. Exit codes: 0 success, 2 bad input (one-line message naming
the field, the value and the fix), 3 no feasible plan. Nothing imports this module.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from megatron_ext.commands import args, checkpoint, evaluate, flexsp, profile, search, validate
from megatron_ext.errors import InfeasiblePlanError, PlanError

# Subcommand modules, in the order `--help` lists them.
COMMAND_MODULES = (search, evaluate, args, validate, profile, flexsp, checkpoint)

logger = logging.getLogger("megatron_ext")


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2, like PlanError."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"megatron-ext: error: {message}; see megatron-ext --help\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="megatron-ext", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in COMMAND_MODULES:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="[megatron_ext] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except PlanError as err:
        sys.stderr.write(f"megatron-ext: error: {err}\n")
        return 2
    except InfeasiblePlanError as err:
        sys.stderr.write(f"megatron-ext: infeasible: {err}\n")
        return 3
    except BrokenPipeError:  # `megatron-ext ... | head` closed our stdout: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit flush
        return 0


if __name__ == "__main__":
    sys.exit(main())
