"""Everything a pretrain_gpt.py run checks before training, in one process without a group.

`megatron-ext launch` calls `check_run` before it starts torchrun: the flags (entry.py's
checks), the tokenizer's vocabulary, the plan the flags or --strategy-config describe on the
job's world size, the backend that will run it and the settings it refuses, and the checkpoint
--load names (verified files, then whether its layer keys and optimizer state load under this
plan). Each problem is the one-line PlanError the ranks would raise later, after the process
group and the model are built; nothing here joins a process group or builds a model.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from megatron_ext.errors import PlanError
from megatron_ext.flags.parser import parse_megatron_args
from megatron_ext.megatron_adapter.training.checkpoint_files import (
    LoadTarget,
    check_checkpoints,
)
from megatron_ext.megatron_adapter.training.entry import check_device, check_supported
from megatron_ext.plan import ParallelPlan


def check_flags(argv: Sequence[str], world_size: int | None) -> tuple[argparse.Namespace,
                                                                        LoadTarget | None]:
    """entry.main's checks before torch: the parsed flags and the verified --load target."""
    args = parse_megatron_args(list(argv), world_size=world_size)
    check_supported(args)
    target = check_checkpoints(args)
    return args, target


def check_run(argv: Sequence[str], world_size: int | None) -> str:
    """Check a pretrain_gpt.py command line for a job of `world_size` ranks (None: elastic,
    unknown until rendezvous: the plan is then not checked); returns a one-line summary."""
    args, target = check_flags(argv, world_size)
    check_device(args)
    if world_size is None:
        return "flags checked (world size unknown until rendezvous: plan not checked)"
    from megatron_ext.flags.to_plan import plan_from_megatron_args
    from megatron_ext.megatron_adapter.sp_norm import have_transformer_engine
    from megatron_ext.megatron_adapter.training.pretrain import (
        _have_apex_wgrad_kernel,
        _padded_vocab,
        tokenizer_from_config,
    )
    from megatron_ext.megatron_adapter.training.run_config import (
        build_run_config,
        tokenizer_config,
    )
    from megatron_ext.megatron_adapter.training.select import (
        check_backend_settings,
        select_backend,
    )

    try:
        tokenizer = tokenizer_from_config(tokenizer_config(args))
    except (OSError, ValueError) as err:  # missing or unreadable tokenizer files
        raise PlanError(f"--tokenizer-type={args.tokenizer_type}: the tokenizer cannot be "
                        f"built ({err}); check --vocab-file/--merge-file/--tokenizer-model"
                        ) from None
    plan = plan_from_megatron_args(args, world_size, vocab_size=tokenizer.vocab_size)
    run = build_run_config(args, plan, cpu=bool(args.cpu), have_te=have_transformer_engine(),
                           have_wgrad_kernel=_have_apex_wgrad_kernel())
    backend = select_backend(run)
    check_backend_settings(run, backend)
    info = _checkpoint_info(target)
    _padded_vocab(run, tokenizer.vocab_size, info)
    if info is not None:
        check_load(info, args, plan, use_transformer_engine=run.model.use_transformer_engine)
    loads = "no checkpoint" if target is None else f"{target.directory}"
    return f"{plan.model.name} on {world_size} ranks, pp={plan.pp}, {backend} backend, {loads}"


def _checkpoint_info(target: LoadTarget | None) -> dict[str, Any] | None:
    from megatron_ext.megatron_adapter.training.checkpoint import checkpoint_info

    return checkpoint_info(target) if target is not None else None


def check_load(info: dict[str, Any], args: argparse.Namespace, plan: ParallelPlan, *,
               use_transformer_engine: bool) -> None:
    """What pretrain.run and load_checkpoint refuse about a checkpoint (`info`: its
    megatron_ext record) under `plan`, before a model exists: stacked layer keys under a plan
    only the layerwise runtime runs and, for checkpoints in megatron-core's chained optimizer
    layout (written before optimizer state was keyed by parameter), another optimizer chain or
    ZeRO level."""
    from megatron_ext.megatron_adapter.training.checkpoint import (
        check_layer_keys,
        check_optimizer_layout,
    )
    from megatron_ext.megatron_adapter.training.checkpoint_optim import PARAM_KEYED

    check_layer_keys(info, plan, args.load)
    if args.no_load_optim or args.finetune or info.get("optimizer_layout") == PARAM_KEYED:
        return  # parameter-keyed optimizer state reshards to any plan (checkpoint_optim.py)
    check_optimizer_layout(info, plan, args.load, use_transformer_engine=use_transformer_engine)
    check_optimizer_kind(info, plan, args.load, use_transformer_engine=use_transformer_engine)


def optimizer_kinds(plan: ParallelPlan, *, use_transformer_engine: bool) -> list[str]:
    """Per pipeline stage, the optimizer kind ('distributed', 'local', 'sharded', or several
    joined by '+') the backend running `plan` builds there: checkpoint.py's
    `_optimizer_format` of the live optimizer, computed from the plan alone."""
    from megatron_ext.megatron_adapter.ddp import chain_kinds
    from megatron_ext.megatron_adapter.training.select import chain_format

    if chain_format(plan, use_transformer_engine=use_transformer_engine) == "layerwise":
        return ["+".join(sorted(set(kinds))) for kinds in chain_kinds(plan)]
    # stock and FlexSP: one megatron-core optimizer per rank, distributed from ZeRO-1 on
    kind = "distributed" if plan.layers[0].zero >= 1 else "local"
    return [kind] * plan.pp


def check_optimizer_kind(info: dict[str, Any], plan: ParallelPlan, root: str, *,
                         use_transformer_engine: bool) -> None:
    """load_checkpoint's refusal of a ZeRO-level change (distributed vs local optimizer
    state), stage by stage, with the same message."""
    from megatron_ext.megatron_adapter.training.select import chain_format

    now = optimizer_kinds(plan, use_transformer_engine=use_transformer_engine)
    chain = info.get("optimizer_chain")
    layerwise = chain_format(plan, use_transformer_engine=use_transformer_engine) == "layerwise"
    for stage, kind in enumerate(now):
        if chain and layerwise and len(chain) == plan.pp:
            saved = "+".join(sorted(set(chain[stage])))
        else:
            saved = info["optimizer_format"]
        if saved != kind:
            raise PlanError(
                f"--load={root} holds {saved} optimizer state but this plan uses the {kind} "
                "optimizer (the ZeRO level changed); add --no-load-optim to restart the "
                "optimizer moments, or keep the ZeRO level"
                + (" (--use-distributed-optimizer)" if saved == "distributed" else ""))
