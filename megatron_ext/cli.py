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
import re
import sys
from collections.abc import Sequence

from megatron_ext.commands import (
    args,
    checkpoint,
    evaluate,
    flexsp,
    launch,
    profile,
    search,
    validate,
)
from megatron_ext.errors import InfeasiblePlanError, PlanError
from megatron_ext.schema import closest
from megatron_ext.warning_filters import install as install_warning_filters

# Subcommand modules, in the order `--help` lists them.
COMMAND_MODULES = (search, evaluate, args, validate, profile, flexsp, launch, checkpoint)

logger = logging.getLogger("megatron_ext")


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2, like PlanError."""

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = self._closest_hint(message)
        sys.stderr.write(f"megatron-ext: error: {message}{hint}; see megatron-ext --help\n")
        raise SystemExit(2)

    def _closest_hint(self, message: str) -> str:
        """'; did you mean --global-batch-size?' for a misspelt option of any subcommand (or
        of this parser), the closest one by schema.closest; '' when none is close."""
        choice = re.match(r"argument command: invalid choice: '([^']*)'", message)
        if choice:
            commands = [c for a in self._actions if isinstance(a, argparse._SubParsersAction)
                        for c in a.choices]
            hint = closest(choice.group(1), commands)
            return f"; did you mean {hint}?" if hint else ""
        if not message.startswith("unrecognized arguments: "):
            return ""
        given = message.removeprefix("unrecognized arguments: ").split()[0].split("=", 1)[0]
        if not given.startswith("--"):
            return ""
        options = set(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for parser in action.choices.values():
                    options |= set(parser._option_string_actions)
        hint = closest(given, [o for o in options if o.startswith("--")])
        return f"; did you mean {hint}?" if hint else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="megatron-ext", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in COMMAND_MODULES:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    install_warning_filters()  # before any subcommand imports megatron-core
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="[megatron_ext] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # torchrun's command line, untouched by this parser
        return launch.main(argv[1:])
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
