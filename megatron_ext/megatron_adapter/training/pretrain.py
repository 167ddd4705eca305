"""Entry of `examples/pretrain_gpt.py`: Megatron-LM flags in, a trained (and saved) model out.

Order (mcore_cpu.md section 7.2): init the process group, apply the CPU patches when running on
gloo, derive the plan, build tokenizer -> model/optimizer -> scheduler, load a checkpoint, build
datasets, train. The flags arrive parsed and checked by entry.py, which also prints errors.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.errors import PlanError
from megatron_ext.flags.to_plan import plan_from_megatron_args
from megatron_ext.megatron_adapter.training.checkpoint import (
    TrainState,
    check_optimizer_layout,
    checkpoint_info,
    load_checkpoint,
    prewarm_checkpoint_writer,
)
from megatron_ext.megatron_adapter.training.data import build_datasets
from megatron_ext.megatron_adapter.training.loop import build_scheduler, train
from megatron_ext.megatron_adapter.training.model_config import padded_vocab_size
from megatron_ext.megatron_adapter.training.select import build_backend
from megatron_ext.megatron_adapter.training.tokenizer import build_tokenizer
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.report import format_duration

logger = logging.getLogger("megatron_ext.pretrain")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(args: argparse.Namespace) -> None:
    """Join the torchrun job (or a one-process job when not launched by torchrun)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    on_cpu = bool(getattr(args, "cpu", False))  # without it entry.check_device required CUDA
    if not on_cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    minutes = getattr(args, "distributed_timeout_minutes", None) or 10
    dist.init_process_group("gloo" if on_cpu else "nccl", timeout=timedelta(minutes=minutes))
    if on_cpu:
        from megatron_ext.megatron_adapter.cpu import compat as cpu_compat

        cpu_compat.apply(force=True)


def _log_startup(args: argparse.Namespace, plan: ParallelPlan, tokenizer: Any) -> None:
    """Rank 0's first lines: plan, ranks, device, precision, layers, data, what gets loaded."""
    if dist.get_rank() != 0:
        return
    device = (f"{torch.cuda.get_device_name()}, nccl" if dist.get_backend() == "nccl"
              else "cpu, gloo")
    lines = [f"plan: {plan.model.name} on {plan.world_size} ranks ({device}), pp={plan.pp}, "
             f"micro batch {plan.micro_batch_size} (all replicas), global batch "
             f"{plan.global_batch_size}, seq {plan.seq_length}, {plan.precision}"]
    for start, end, strategy in plan.layer_runs():
        lines.append(f"  layers [{start:>3}, {end:>3})  stage {plan.stage_of_layer(start)}  "
                     f"{strategy.describe()}")
    if plan.prediction is not None:
        lines.append(f"  predicted iteration {format_duration(plan.prediction.iteration_time_s)}, "
                     f"{plan.prediction.tokens_per_s:.0f} tokens/s")
    data = "mock data" if getattr(args, "mock_data", False) else " ".join(
        getattr(args, "data_path", None) or ["per-split paths"])
    lines.append(f"  data: {_shorten(data)}; tokenizer {getattr(args, 'tokenizer_type', None)}, "
                 f"vocab {tokenizer.vocab_size}")
    load = getattr(args, "load", None)
    lines.append(f"  load: {_shorten(load)}" if load else "  load: none (random initialisation)")
    logger.info("\n".join(lines))


def _shorten(text: str, limit: int = 120) -> str:
    """Keep a line under ~200 characters: long paths keep their start and end."""
    return text if len(text) <= limit else f"{text[:limit // 2 - 2]}...{text[-(limit // 2 - 1):]}"


def _padded_vocab(args: argparse.Namespace, plan: ParallelPlan, vocab_size: int,
                  info: dict[str, Any] | None) -> int:
    """Megatron's padding, unless a checkpoint being resumed fixed it and this plan can use it."""
    multiple = plan.vocab.tp * (plan.pp if plan.vocab.mode == "vocab_parallel" else 1)
    saved = int(info["padded_vocab_size"]) if info else None
    if saved is not None and saved >= vocab_size and saved % multiple == 0:
        return saved
    if saved is not None:
        raise PlanError(f"--load checkpoint has a vocabulary padded to {saved} rows, which does "
                        f"not split over the {multiple} vocabulary shards of this plan")
    return padded_vocab_size(vocab_size, args, multiple)


def tokenizer_from_args(args: argparse.Namespace) -> Any:
    return build_tokenizer(
        tokenizer_type=getattr(args, "tokenizer_type", None),
        vocab_file=getattr(args, "vocab_file", None), merge_file=getattr(args, "merge_file", None),
        tokenizer_model=getattr(args, "tokenizer_model", None),
        vocab_size=getattr(args, "vocab_size", None))


def run(args: argparse.Namespace, plan: ParallelPlan, tokenizer: Any) -> TrainState:
    """Train under `plan`; the process group is initialised."""
    _log_startup(args, plan, tokenizer)
    # With --strategy-config the plan carries the batch shape; the loop reads it from args.
    args.global_batch_size = plan.global_batch_size
    args.seq_length = plan.seq_length
    if getattr(args, "save", None):
        prewarm_checkpoint_writer()
    info = checkpoint_info(args.load) if getattr(args, "load", None) else None
    load_optimizer = not (getattr(args, "no_load_optim", False)
                          or getattr(args, "finetune", False))
    if info is not None and load_optimizer:
        check_optimizer_layout(info, plan, args.load)
    backend = build_backend(args, plan, _padded_vocab(args, plan, tokenizer.vocab_size, info),
                            model_format=info.get("model_format", "megatron") if info else None,
                            eod=tokenizer.eod if plan.flexsp is not None else None)
    scheduler = build_scheduler(args, backend.optimizer)
    state = TrainState()
    if getattr(args, "load", None):
        finetune = bool(getattr(args, "finetune", False))
        loaded = load_checkpoint(
            args.load, backend, scheduler, plan,
            load_optimizer=load_optimizer,
            load_rng=not (getattr(args, "no_load_rng", False) or finetune))
        if loaded is None and getattr(args, "exit_on_missing_checkpoint", False):
            raise PlanError(f"--load={args.load} holds no checkpoint "
                            "(--exit-on-missing-checkpoint)")
        state = TrainState() if finetune or loaded is None else loaded
    datasets = build_datasets(args, tokenizer)
    return train(args, plan, backend, scheduler, datasets, state)


def launch(args: argparse.Namespace) -> int:
    """Join the process group, derive the plan, train; `args` are parsed and checked (entry.py).

    A PlanError propagates to the entry point, which prints it once."""
    init_distributed(args)
    try:
        tokenizer = tokenizer_from_args(args)
        plan = plan_from_megatron_args(args, dist.get_world_size(),
                                       vocab_size=tokenizer.vocab_size)
        run(args, plan, tokenizer)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0
