"""The run configuration: Megatron-LM flags parsed once, resolved against the plan, frozen.

`pretrain_gpt.py` parses its flags once (flags/parser.py), derives the plan once, and builds one
`RunConfig` from both; everything below `pretrain.run` (backends, loop, data, scheduler) reads
this object and never the argparse namespace. Defaults live in the parser only: the builder
reads every dest directly, so a flag the parser lacks is an AttributeError here, not a second
default. Megatron-LM's `validate_args` rewrites (bf16 -> fp32 gradient reduction, fp16 dynamic
loss scaling -> no NaN check, sample- vs iteration-based schedules) are applied here, once.

Three batch counts, three names:
- `BatchConfig.global_micro_batch_size`: samples of one micro-batch of all data-parallel replicas
  together (the plan's `micro_batch_size`);
- Megatron's `--micro-batch-size` (one replica) is the plan's value divided by dp, and exists
  only for uniform plans: it is not kept;
- `Backend.rank_micro_batch_size`: samples of one micro-batch this rank reads.
"""

from __future__ import annotations

import argparse
import signal
from dataclasses import dataclass
from typing import Literal

from megatron_ext.errors import PlanError
from megatron_ext.flags.schedule import check_schedule_flags
from megatron_ext.megatron_adapter.training.rampup import check_rampup, global_batch_size_at
from megatron_ext.megatron_adapter.transformer_config import ModelOptions
from megatron_ext.plan import ParallelPlan

__all__ = [
    "BatchConfig",
    "CheckpointConfig",
    "DataConfig",
    "LoggingConfig",
    "OptimizerOptions",
    "RunConfig",
    "ScheduleConfig",
    "SystemConfig",
    "TokenizerConfig",
    "build_run_config",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchConfig:
    """Batch shape of every step (from the plan)."""

    global_batch_size: int
    """Samples per optimizer step, all replicas (the final one when batch sizes ramp up)."""
    global_micro_batch_size: int
    """Samples of one micro-batch of all data-parallel replicas together (plan.micro_batch_size)."""
    seq_length: int
    """Tokens per sample."""
    rampup_batch_size: tuple[int, int, int] | None
    """--rampup-batch-size START INCREMENT SAMPLES; the plan is made for the final batch size."""

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step at the final batch size."""
        return self.global_batch_size // self.global_micro_batch_size


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerOptions:
    """megatron-core OptimizerConfig and DistributedDataParallelConfig settings."""

    optimizer: Literal["adam", "sgd"]
    lr: float
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    sgd_momentum: float
    clip_grad: float
    loss_scale: float | None
    """Static fp16 loss scale; None: dynamic."""
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: float
    hysteresis: int
    grad_reduce_in_fp32: bool
    """Accumulate and all-reduce gradients in fp32 (main_grad fp32). Megatron-LM forces it for
    bf16 unless --grad-reduce-in-bf16 (arguments.py validate_args); otherwise
    --accumulate-allreduce-grads-in-fp32."""
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    ddp_bucket_size: int | None
    calculate_per_token_loss: bool
    """--calculate-per-token-loss: divide by the global batch's loss tokens (the layerwise
    runtime and FlexSP always do)."""
    check_for_nan_in_loss_and_grad: bool
    """Megatron-LM's default True; off with --no-check-for-nan-in-loss-and-grad and for fp16 with
    dynamic loss scaling (the scaler uses NaNs as its signal)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleConfig:
    """Run length, learning-rate / weight-decay schedule and evaluation, Megatron-LM's
    `get_optimizer_param_scheduler` in samples (iteration counts are converted once here)."""

    train_iters: int
    """Optimizer steps of the whole run (with --train-samples: Megatron's update_train_iters)."""
    train_samples: int
    """Samples of the whole run (sample-based: --train-samples; else train_iters x gbs)."""
    lr_decay_style: str
    lr_decay_samples: int
    lr_warmup_samples: float
    lr_warmup_init: float
    lr_wsd_decay_style: str
    lr_wsd_decay_samples: int | None
    start_weight_decay: float
    end_weight_decay: float
    weight_decay_incr_style: str
    use_checkpoint_opt_param_scheduler: bool
    override_opt_param_scheduler: bool
    exit_interval: int | None
    exit_duration_in_mins: int | None
    exit_signals: tuple[int, ...]
    """--exit-signal-handler: --exit-signal and SIGINT save and stop the run; else empty."""
    eval_interval: int | None
    eval_iters: int


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Datasets (megatron-core GPTDatasetConfig) and the loader."""

    data_path: tuple[str, ...] | None
    split: str | None
    train_data_path: tuple[str, ...] | None
    valid_data_path: tuple[str, ...] | None
    test_data_path: tuple[str, ...] | None
    data_cache_path: str | None
    mock_data: bool
    mmap_bin_files: bool
    """False with --no-mmap-bin-files."""
    num_workers: int
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    save: str | None
    save_interval: int | None
    load: str | None
    ckpt_step: int | None
    """--ckpt-step: the iteration loaded from --load instead of the tracker file's."""
    no_load_optim: bool
    no_load_rng: bool
    finetune: bool
    exit_on_missing_checkpoint: bool
    no_save_optim: bool = False
    """Megatron-LM's --no-save-optim: checkpoints hold no optimizer state."""
    async_save: bool = False
    """--async-save: shards are written in the background (checkpoint_async.py)."""
    use_persistent_ckpt_worker: bool = False
    """--use-persistent-ckpt-worker: one writer process for the run instead of one per save."""
    ckpt_assume_constant_structure: bool = False
    """--ckpt-assume-constant-structure: saves reuse the first save's plan (one cached
    torch_dist save strategy for the run, as in Megatron-LM)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    log_interval: int
    tensorboard_dir: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerConfig:
    tokenizer_type: str | None
    vocab_file: str | None
    merge_file: str | None
    tokenizer_model: str | None
    vocab_size: int | None


InitMethod = Literal["plan_invariant", "megatron"]
"""How weights are initialised: "plan_invariant" (each tensor drawn whole from a generator seeded
by --seed and its global name, then sharded: the same model under every plan and backend) or
"megatron" (--megatron-init: megatron-core's own per-rank init, as Megatron-LM draws it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SystemConfig:
    seed: int
    init: InitMethod = "plan_invariant"
    """Weight initialisation (InitMethod)."""
    cpu: bool
    """--cpu, or no CUDA device: gloo, CPU patches, no fused kernels."""
    distributed_timeout_minutes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything below `pretrain.run` reads: the plan and the resolved flags, by concern."""

    plan: ParallelPlan
    model: ModelOptions
    batch: BatchConfig
    optimizer: OptimizerOptions
    schedule: ScheduleConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    tokenizer: TokenizerConfig
    system: SystemConfig


def _tuple(value: list[str] | None) -> tuple[str, ...] | None:
    return tuple(value) if value else None


def _model(ns: argparse.Namespace, *, cpu: bool, swiglu: bool, have_te: bool,
           have_wgrad_kernel: bool) -> ModelOptions:
    fused = not cpu
    return ModelOptions(
        hidden_dropout=ns.hidden_dropout, attention_dropout=ns.attention_dropout,
        init_method_std=ns.init_method_std,
        apply_query_key_layer_scaling=ns.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=ns.attention_softmax_in_fp32,
        rotary_seq_len_interpolation_factor=ns.rotary_seq_len_interpolation_factor,
        make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by,
        use_transformer_engine=ns.transformer_impl == "transformer_engine" and have_te,
        use_cpu_initialization=bool(ns.use_cpu_initialization) or cpu,
        masked_softmax_fusion=fused and ns.masked_softmax_fusion,
        bias_activation_fusion=fused and (ns.bias_swiglu_fusion if swiglu
                                          else ns.bias_gelu_fusion),
        bias_dropout_fusion=fused and ns.bias_dropout_fusion,
        apply_rope_fusion=fused and ns.apply_rope_fusion,
        gradient_accumulation_fusion=fused and ns.gradient_accumulation_fusion
        and have_wgrad_kernel,
        moe_token_dispatcher_type=ns.moe_token_dispatcher_type,
        moe_grouped_gemm=bool(ns.moe_grouped_gemm),
        moe_router_dtype=ns.moe_router_dtype,
        moe_input_jitter_eps=ns.moe_input_jitter_eps,
        moe_pad_expert_input_to_capacity=bool(ns.moe_pad_expert_input_to_capacity),
    )


def _optimizer(ns: argparse.Namespace, plan: ParallelPlan) -> OptimizerOptions:
    if ns.optimizer not in ("adam", "sgd"):
        raise PlanError(f"--optimizer {ns.optimizer} is not supported; use adam or sgd")
    if plan.precision == "bf16":  # arguments.py validate_args: bf16 reduces in fp32 ...
        grad_fp32 = not ns.grad_reduce_in_bf16  # ... unless --grad-reduce-in-bf16
    else:
        grad_fp32 = bool(ns.accumulate_allreduce_grads_in_fp32)
    nan_check = bool(ns.check_for_nan_in_loss_and_grad)
    if plan.precision == "fp16" and not ns.loss_scale:  # dynamic scaling reads NaNs itself
        nan_check = False
    return OptimizerOptions(
        optimizer=ns.optimizer, lr=ns.lr, min_lr=ns.min_lr, weight_decay=ns.weight_decay,
        adam_beta1=ns.adam_beta1, adam_beta2=ns.adam_beta2, adam_eps=ns.adam_eps,
        sgd_momentum=ns.sgd_momentum, clip_grad=ns.clip_grad, loss_scale=ns.loss_scale,
        initial_loss_scale=ns.initial_loss_scale, min_loss_scale=ns.min_loss_scale,
        loss_scale_window=ns.loss_scale_window, hysteresis=ns.hysteresis,
        grad_reduce_in_fp32=grad_fp32, overlap_grad_reduce=ns.overlap_grad_reduce,
        overlap_param_gather=ns.overlap_param_gather, ddp_bucket_size=ns.ddp_bucket_size,
        calculate_per_token_loss=ns.calculate_per_token_loss,
        check_for_nan_in_loss_and_grad=nan_check,
    )


def rampup_train_iters(batch: BatchConfig, train_samples: int) -> int:
    """Megatron-LM's update_train_iters (training.py) with --rampup-batch-size."""
    assert batch.rampup_batch_size is not None
    iterations = consumed = 0
    while consumed <= batch.rampup_batch_size[2] and consumed <= train_samples:
        consumed += global_batch_size_at(batch, consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // batch.global_batch_size
    return iterations


def _exit_signals(ns: argparse.Namespace) -> tuple[int, ...]:
    """With --exit-signal-handler: --exit-signal (Megatron-LM's default SIGTERM) and SIGINT
    (Ctrl-C), as training/preemption.py catches them; nothing without it."""
    if not ns.exit_signal_handler:
        return ()
    return tuple(dict.fromkeys((signal.Signals(ns.exit_signal), signal.SIGINT)))


def _schedule(ns: argparse.Namespace, batch: BatchConfig) -> ScheduleConfig:
    gbs = batch.global_batch_size
    if ns.train_iters:  # iteration counts in samples, as get_optimizer_param_scheduler does
        train_iters, train_samples = ns.train_iters, ns.train_iters * gbs
        decay = (ns.lr_decay_iters or ns.train_iters) * gbs
        warmup = ns.lr_warmup_iters * gbs
        wsd = ns.lr_wsd_decay_iters * gbs if ns.lr_wsd_decay_iters is not None else None
    else:
        train_samples = ns.train_samples
        train_iters = (rampup_train_iters(batch, train_samples) if batch.rampup_batch_size
                       else train_samples // gbs)
        decay = ns.lr_decay_samples or train_samples
        warmup = ns.lr_warmup_samples
        wsd = ns.lr_wsd_decay_samples
    if ns.lr_warmup_fraction is not None:
        warmup = ns.lr_warmup_fraction * decay
    if train_iters < 1:
        raise PlanError(f"--train-samples={train_samples} is less than one global batch "
                        f"({gbs} samples)")
    weight_decay = ns.weight_decay
    return ScheduleConfig(
        train_iters=train_iters, train_samples=train_samples,
        lr_decay_style=ns.lr_decay_style, lr_decay_samples=decay, lr_warmup_samples=warmup,
        lr_warmup_init=ns.lr_warmup_init, lr_wsd_decay_style=ns.lr_wsd_decay_style,
        lr_wsd_decay_samples=wsd,
        start_weight_decay=weight_decay if ns.start_weight_decay is None
        else ns.start_weight_decay,
        end_weight_decay=weight_decay if ns.end_weight_decay is None else ns.end_weight_decay,
        weight_decay_incr_style=ns.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=ns.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=ns.override_opt_param_scheduler,
        exit_interval=ns.exit_interval, exit_duration_in_mins=ns.exit_duration_in_mins,
        exit_signals=_exit_signals(ns), eval_interval=ns.eval_interval, eval_iters=ns.eval_iters,
    )


def _batch(ns: argparse.Namespace, plan: ParallelPlan) -> BatchConfig:
    rampup = tuple(ns.rampup_batch_size) if ns.rampup_batch_size else None
    batch = BatchConfig(global_batch_size=plan.global_batch_size,
                        global_micro_batch_size=plan.micro_batch_size,
                        seq_length=plan.seq_length, rampup_batch_size=rampup)
    if rampup is not None:
        check_rampup(batch)
    return batch


def build_run_config(ns: argparse.Namespace, plan: ParallelPlan, *, cpu: bool,
                     have_te: bool, have_wgrad_kernel: bool) -> RunConfig:
    """The run configuration of validated flags `ns` under `plan` (ns is not modified).

    `cpu`: the job runs on gloo without CUDA; `have_te` / `have_wgrad_kernel`: whether
    transformer-engine and apex's weight-gradient kernel import (the caller probes them)."""
    check_schedule_flags(ns)
    batch = _batch(ns, plan)
    return RunConfig(
        plan=plan,
        model=_model(ns, cpu=cpu, swiglu=plan.model.activation == "swiglu", have_te=have_te,
                     have_wgrad_kernel=have_wgrad_kernel),
        batch=batch,
        optimizer=_optimizer(ns, plan),
        schedule=_schedule(ns, batch),
        data=DataConfig(
            data_path=_tuple(ns.data_path), split=ns.split,
            train_data_path=_tuple(ns.train_data_path),
            valid_data_path=_tuple(ns.valid_data_path), test_data_path=_tuple(ns.test_data_path),
            data_cache_path=ns.data_cache_path, mock_data=ns.mock_data,
            mmap_bin_files=ns.mmap_bin_files, num_workers=ns.num_workers,
            reset_position_ids=ns.reset_position_ids,
            reset_attention_mask=ns.reset_attention_mask, eod_mask_loss=ns.eod_mask_loss),
        checkpoint=CheckpointConfig(
            save=ns.save, save_interval=ns.save_interval, load=ns.load, ckpt_step=ns.ckpt_step,
            no_load_optim=bool(ns.no_load_optim), no_load_rng=bool(ns.no_load_rng),
            finetune=ns.finetune, exit_on_missing_checkpoint=ns.exit_on_missing_checkpoint,
            no_save_optim=bool(ns.no_save_optim), async_save=ns.async_save,
            use_persistent_ckpt_worker=ns.use_persistent_ckpt_worker,
            ckpt_assume_constant_structure=ns.ckpt_assume_constant_structure),
        logging=LoggingConfig(log_interval=ns.log_interval, tensorboard_dir=ns.tensorboard_dir),
        tokenizer=tokenizer_config(ns),
        system=SystemConfig(seed=ns.seed, cpu=cpu,
                            init="megatron" if ns.megatron_init else "plan_invariant",
                            distributed_timeout_minutes=ns.distributed_timeout_minutes),
    )


def tokenizer_config(ns: argparse.Namespace) -> TokenizerConfig:
    """The tokenizer flags (read before the plan: the plan records the vocabulary size)."""
    return TokenizerConfig(tokenizer_type=ns.tokenizer_type, vocab_file=ns.vocab_file,
                           merge_file=ns.merge_file, tokenizer_model=ns.tokenizer_model,
                           vocab_size=ns.vocab_size)
