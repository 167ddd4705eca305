"""`examples/pretrain_gpt.py` main: flags checked first, then torch, megatron-core and the group.

Importing this module loads neither torch nor megatron-core: the flags are parsed and validated
(megatron_ext.flags, pure Python) before either is imported, so a typo comes back in a fraction of
a second on every rank instead of after megatron-core's import and the process group. Errors end
the run with one line and exit code 2 (console.report_user_error: one rank prints, torchrun's
root-cause block shows the same line); an unexpected exception keeps its traceback and is
recorded in torchrun's error file, as torch's `@record` does.

No CUDA device and no --cpu is refused: a Megatron-LM user launching on a GPU node expects NCCL
on GPUs, and a silent fall-back to gloo on CPU would run ~1000x slower without saying why.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence

from megatron_ext.errors import PlanError
from megatron_ext.flags.catalog import runtime_refusal
from megatron_ext.flags.parser import parse_megatron_args
from megatron_ext.flags.schedule import check_schedule_flags
from megatron_ext.megatron_adapter.compat_versions import (
    check_megatron_core,
    check_version_features,
)
from megatron_ext.megatron_adapter.training import console
from megatron_ext.megatron_adapter.training.checkpoint_files import check_checkpoints

logger = logging.getLogger("megatron_ext.pretrain")

def check_supported(args: argparse.Namespace) -> None:
    """What this loop needs beyond the flag table (flags/catalog.py refuses what it lacks):
    a run length and a learning rate, iteration- or sample-based as Megatron-LM checks them;
    no feature not yet verified on the installed megatron-core; no flag only the planner
    prices (flags/catalog.py PLANNER_ONLY: --tp-comm-overlap, from the flags or the plan)."""
    if args.tp_comm_overlap:
        raise PlanError(runtime_refusal("--tp-comm-overlap"))
    check_schedule_flags(args)
    check_version_features(args)


def check_device(args: argparse.Namespace) -> None:
    """Without --cpu the run needs CUDA (NCCL), as Megatron-LM's does; say so in one line."""
    if args.cpu:
        return
    import torch

    if not torch.cuda.is_available():
        raise PlanError("no CUDA device is visible and --cpu is not given; pass --cpu to train "
                        "on CPU with gloo, or check CUDA_VISIBLE_DEVICES and the driver")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse Megatron-LM flags, train, return the exit code."""
    console.install_warning_filters()
    start_time_s = time.time()
    argv = sys.argv[1:] if argv is None else list(argv)
    rank = console.rank_from_env()
    try:
        check_megatron_core()  # compat_versions.SUPPORTED_RANGE, before torch and any group
        args = parse_megatron_args(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        check_supported(args)
        target = check_checkpoints(args)  # verified --load, no rollback of --save
    except PlanError as err:
        return console.report_user_error(str(err), rank=rank)
    console.install_warning_filters(cpu=bool(args.cpu))
    console.setup_logging(rank=rank,
                          level=console.logging_level(args.logging_level))
    if rank == 0:
        for note in args.no_effect_notes:  # flags/catalog.py: once, with why
            logger.info(note)
    try:
        check_device(args)
        from megatron_ext.megatron_adapter.fp8 import check_fp8_runtime

        check_fp8_runtime(args.fp8, args.fp8_recipe, cpu=bool(args.cpu),  # before any group
                          transformer_impl=args.transformer_impl)
        from megatron_ext.megatron_adapter.training.pretrain import launch

        return launch(args, start_time_s=start_time_s, target=target)
    except PlanError as err:
        return console.report_user_error(str(err))
    except Exception as err:
        console.record_exception(err)
        raise
