"""Megatron-LM's rules for iteration- vs sample-based runs (arguments.py validate_args,
core_v0.16.1): checked with the other flags, before torch or a process group."""

from __future__ import annotations

import argparse

from megatron_ext.errors import PlanError

__all__ = ["check_schedule_flags"]


def check_schedule_flags(ns: argparse.Namespace) -> None:
    """Megatron-LM's validate_args rules for iteration- vs sample-based runs, as one-line
    PlanErrors (before any process group)."""
    if ns.train_iters and ns.train_samples:
        raise PlanError("--train-iters and --train-samples are exclusive; give one")
    if not ns.train_iters and not ns.train_samples:
        raise PlanError("--train-iters or --train-samples is required")
    if ns.train_iters:
        for dest, unset in (("lr_decay_samples", None), ("lr_warmup_samples", 0),
                            ("lr_wsd_decay_samples", None), ("rampup_batch_size", None)):
            if getattr(ns, dest) != unset:
                raise PlanError(f"--{dest.replace('_', '-')} needs sample-based training "
                                "(--train-samples); with --train-iters use the -iters flags")
        if ns.lr_warmup_fraction is not None and ns.lr_warmup_iters:
            raise PlanError("--lr-warmup-fraction and --lr-warmup-iters are exclusive; give one")
    else:
        for dest, unset in (("lr_decay_iters", None), ("lr_warmup_iters", 0),
                            ("lr_wsd_decay_iters", None)):
            if getattr(ns, dest) != unset:
                raise PlanError(f"--{dest.replace('_', '-')} needs iteration-based training "
                                "(--train-iters); with --train-samples use the -samples flags")
        if ns.lr_warmup_fraction is not None and ns.lr_warmup_samples:
            raise PlanError("--lr-warmup-fraction and --lr-warmup-samples are exclusive; "
                            "give one")
    if ns.lr is None:
        raise PlanError("--lr is required")
