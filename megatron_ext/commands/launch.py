"""`megatron-ext launch`: torchrun, once pretrain_gpt.py's flags, plan and --load are checked.

    megatron-ext launch [torchrun options] examples/pretrain_gpt.py [pretrain_gpt.py flags]

The command line is torchrun's, word for word (replace `torchrun` with `megatron-ext launch`; a
`--` before the script is allowed, as torchrun allows it). torch's own torchrun parser reads the
options (their PET_* environment variables included) and the world size (nnodes x
nproc_per_node). For megatron_ext's pretrain_gpt.py, one process then checks what every rank
would check later (megatron_adapter/training/preflight.py): the flags, the tokenizer, the plan on
that world size, the backend's settings, and the checkpoint --load names, including whether its
optimizer state loads under this plan. A problem is one line on stderr and exit code 2, and no
worker starts; otherwise this process becomes torchrun (`python -m torch.distributed.run`, same
arguments), so signals, exit codes and Slurm behave as torchrun's. Other scripts are started
unchecked, with a note. With an elastic `--nnodes MIN:MAX` the world size is unknown until the
rendezvous: the flags are checked, the plan is not.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_ext.errors import PlanError

PROG = "megatron-ext launch"
ENTRY_MODULE = "megatron_ext.megatron_adapter.training.entry"
"""A script that imports this module is megatron_ext's pretrain_gpt.py (or a copy of it)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", add_help=False,
        help="torchrun after checking pretrain_gpt.py's flags, plan and --load in one process",
        description=__doc__)
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER,
                   help="torchrun's options, the script and its arguments")
    p.set_defaults(run=lambda args: main(args.torchrun_args))


def main(argv: Sequence[str]) -> int:
    """Check, then exec torchrun with `argv`; returns only on an error (2) or for --help (0)."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(__doc__ + "\ntorchrun's options: torchrun --help\n")
        return 0
    try:
        script, script_args, world_size = _parse_torchrun(argv)
        if _is_pretrain_gpt(script):
            summary = _check(script_args, world_size)
            sys.stderr.write(f"{PROG}: checked {summary}; starting torchrun\n")
        else:
            sys.stderr.write(f"{PROG}: note: {script} is not megatron_ext's pretrain_gpt.py; "
                             "its arguments are not checked\n")
    except PlanError as err:
        sys.stderr.write(f"{PROG}: error: {err}\n")
        return 2
    sys.stderr.flush()
    sys.stdout.flush()
    command = [sys.executable, "-m", "torch.distributed.run", *argv]
    os.execv(sys.executable, command)
    return 0  # not reached


class _TorchrunParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise PlanError(f"torchrun: {message}; see torchrun --help")


def _parse_torchrun(argv: list[str]) -> tuple[str, list[str], int | None]:
    """(script, its arguments, world size or None when elastic) by torch's torchrun parser."""
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    parser.__class__ = _TorchrunParser  # torch builds a plain ArgumentParser
    args = parser.parse_args(argv)
    if args.module or args.no_python:
        script = ("-m " if args.module else "") + args.training_script
    else:
        script = args.training_script
    try:
        min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
        nproc = torchrun.determine_local_world_size(args.nproc_per_node)
    except (ValueError, RuntimeError) as err:
        raise PlanError(f"torchrun: --nnodes={args.nnodes} --nproc-per-node="
                        f"{args.nproc_per_node}: {err}") from None
    if args.standalone:
        min_nodes = max_nodes = 1
    world = nproc * max_nodes if min_nodes == max_nodes else None
    return script, list(args.training_script_args), world


def _is_pretrain_gpt(script: str) -> bool:
    path = Path(script)
    if script.startswith("-m ") or not path.is_file():
        return False
    try:
        return ENTRY_MODULE in path.read_text(errors="replace")
    except OSError:
        return False


def _check(script_args: list[str], world_size: int | None) -> str:
    from megatron_ext.megatron_adapter.training.console import install_warning_filters
    from megatron_ext.megatron_adapter.training.preflight import check_run

    install_warning_filters(cpu="--cpu" in script_args)
    # megatron-core's import-time INFO notes, as pretrain_gpt.py's logging hides them
    logging.getLogger("megatron").setLevel(logging.WARNING)
    return check_run(script_args, world_size)
