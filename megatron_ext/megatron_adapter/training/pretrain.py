"""Entry of `examples/pretrain_gpt.py`: Megatron-LM flags in, a trained (and saved) model out.

Order (patches/README.md, "At runtime"): init the process group, apply the CPU patches when
running on gloo, derive the plan, build tokenizer -> model/optimizer -> scheduler, load a
checkpoint, build datasets, train. The flags arrive parsed and checked by entry.py, which also
prints errors.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.rerun_state_machine import RerunMode, initialize_rerun_state_machine

from megatron_ext.errors import PlanError
from megatron_ext.flags.to_plan import plan_from_megatron_args
from megatron_ext.geometry.vocab_partition import padded_vocab_size
from megatron_ext.megatron_adapter.training.checkpoint import (
    TrainState,
    check_layer_keys,
    check_optimizer_layout,
    checkpoint_info,
    load_checkpoint,
    prewarm_checkpoint_writer,
)
from megatron_ext.megatron_adapter.training.checkpoint_files import LoadTarget
from megatron_ext.megatron_adapter.training.data import build_datasets
from megatron_ext.megatron_adapter.training.loop import build_scheduler, train
from megatron_ext.megatron_adapter.training.run_config import (
    RunConfig,
    TokenizerConfig,
    build_run_config,
    tokenizer_config,
)
from megatron_ext.megatron_adapter.training.select import build_backend
from megatron_ext.megatron_adapter.training.tokenizer import build_tokenizer
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.report import format_duration

logger = logging.getLogger("megatron_ext.pretrain")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _have_apex_wgrad_kernel() -> bool:
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:  # an optional kernel: without it the fusion is off, as in Megatron-LM
        return False
    return True


def run_config_from_args(args: argparse.Namespace, plan: ParallelPlan) -> RunConfig:
    """The run configuration of parsed flags under `plan` (probes the optional
    transformer-engine / apex kernels once)."""
    from megatron_ext.megatron_adapter.sp_norm import have_transformer_engine

    have_te = have_transformer_engine()
    if args.transformer_impl == "transformer_engine" and not have_te and dist.get_rank() == 0:
        logger.warning("--transformer-impl transformer_engine: transformer-engine is not "
                       "installed, using the local (megatron-core) layers")
    return build_run_config(args, plan, cpu=args.cpu, have_te=have_te,
                            have_wgrad_kernel=_have_apex_wgrad_kernel())


def init_distributed(args: argparse.Namespace) -> None:
    """Join the torchrun job (or a one-process job when not launched by torchrun)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    on_cpu = args.cpu  # without it entry.check_device required CUDA
    if not on_cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo" if on_cpu else "nccl",
                            timeout=timedelta(minutes=args.distributed_timeout_minutes))
    if on_cpu:
        from megatron_ext.megatron_adapter.cpu import compat as cpu_compat
        from megatron_ext.runtime.host_memory import keep_freed_memory_mapped

        cpu_compat.apply(force=True)
        keep_freed_memory_mapped()  # as the CUDA caching allocator: no page faults every step


def _log_startup(config: RunConfig, tokenizer: Any) -> None:
    """Rank 0's first lines: plan, ranks, device, precision, layers, data, what gets loaded."""
    if dist.get_rank() != 0:
        return
    plan = config.plan
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
    data = "mock data" if config.data.mock_data else " ".join(
        config.data.data_path or ["per-split paths"])
    lines.append(f"  data: {_shorten(data)}; tokenizer {config.tokenizer.tokenizer_type}, "
                 f"vocab {tokenizer.vocab_size}")
    if config.batch.rampup_batch_size is not None:
        lines.append(f"  --rampup-batch-size {' '.join(map(str, config.batch.rampup_batch_size))}"
                     f": the plan is made for the final global batch of "
                     f"{config.batch.global_batch_size} samples")
    load = config.checkpoint.load
    lines.append(f"  load: {_shorten(load)}" if load else "  load: none (random initialisation)")
    logger.info("\n".join(lines))


def _shorten(text: str, limit: int = 120) -> str:
    """Keep a line under ~200 characters: long paths keep their start and end."""
    return text if len(text) <= limit else f"{text[:limit // 2 - 2]}...{text[-(limit // 2 - 1):]}"


def _padded_vocab(run: RunConfig, vocab_size: int, info: dict[str, Any] | None) -> int:
    """Megatron's padding, unless a checkpoint being resumed fixed it and this plan can use it."""
    plan = run.plan
    multiple = plan.vocab.tp * (plan.pp if plan.vocab.mode == "vocab_parallel" else 1)
    saved = int(info["padded_vocab_size"]) if info else None
    if saved is not None and saved >= vocab_size and saved % multiple == 0:
        return saved
    if saved is not None:
        raise PlanError(f"--load checkpoint has a vocabulary padded to {saved} rows, which does "
                        f"not split over the {multiple} vocabulary shards of this plan")
    return padded_vocab_size(vocab_size, multiple, run.model.make_vocab_size_divisible_by)


def tokenizer_from_config(config: TokenizerConfig) -> Any:
    return build_tokenizer(
        tokenizer_type=config.tokenizer_type, vocab_file=config.vocab_file,
        merge_file=config.merge_file, tokenizer_model=config.tokenizer_model,
        vocab_size=config.vocab_size)


def run(config: RunConfig, tokenizer: Any, *, start_time_s: float | None = None,
        target: LoadTarget | None = None) -> TrainState:
    """Train as `config` says, from the checkpoint `target` (checkpoint_files.check_checkpoints
    verified it before the process group); the process group is initialised."""
    plan, ckpt = config.plan, config.checkpoint
    # Megatron-LM sets its rerun state machine up before training (initialize.py); left to
    # megatron-core's first loss check it is set up implicitly with two WARNING lines. Result
    # validation (--rerun-mode) has no effect here (flags/catalog.py), so: disabled.
    initialize_rerun_state_machine(mode=RerunMode.DISABLED)
    _log_startup(config, tokenizer)
    if ckpt.save:  # shielded from the exit signals: the save after one needs the writer
        prewarm_checkpoint_writer(config.schedule.exit_signals)
    info = checkpoint_info(target)
    load_optimizer = not (ckpt.no_load_optim or ckpt.finetune)
    if info is not None:
        assert ckpt.load is not None  # a checkpoint to load is named by --load (check_checkpoints)
        check_layer_keys(info, plan, ckpt.load)
        if load_optimizer:
            check_optimizer_layout(info, plan, ckpt.load,
                                   use_transformer_engine=config.model.use_transformer_engine)
    backend = build_backend(config, _padded_vocab(config, tokenizer.vocab_size, info),
                            eod=tokenizer.eod if plan.flexsp is not None else None)
    scheduler = build_scheduler(config, backend.optimizer)
    state = TrainState()
    if target is not None:
        state = load_checkpoint(
            target, backend, scheduler, plan, load_optimizer=load_optimizer,
            load_rng=not (ckpt.no_load_rng or ckpt.finetune), finetune=ckpt.finetune)
    elif ckpt.load and dist.get_rank() == 0:
        logger.warning("no checkpoint under --load=%s; starting from scratch", ckpt.load)
    datasets = build_datasets(config, tokenizer)
    return train(config, backend, scheduler, datasets, state,
                 start_time_s=time.time() if start_time_s is None else start_time_s)


def launch(args: argparse.Namespace, *, start_time_s: float | None = None,
           target: LoadTarget | None = None) -> int:
    """Join the process group, derive the plan, train; `args` are parsed and checked (entry.py).
    `start_time_s`: when the job started (--exit-duration-in-mins counts from it); `target`:
    the verified checkpoint to load (checkpoint_files.check_checkpoints), if any.

    A PlanError propagates to the entry point, which prints it once."""
    start_time_s = time.time() if start_time_s is None else start_time_s
    init_distributed(args)
    try:
        tokenizer = tokenizer_from_config(tokenizer_config(args))
        plan = plan_from_megatron_args(args, dist.get_world_size(),
                                       vocab_size=tokenizer.vocab_size)
        run(run_config_from_args(args, plan), tokenizer, start_time_s=start_time_s,
            target=target)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0
