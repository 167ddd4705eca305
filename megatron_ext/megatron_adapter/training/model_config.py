"""megatron-core configs of a run: TransformerConfig (transformer_config.py maps the model),
OptimizerConfig and DistributedDataParallelConfig, all from the RunConfig."""

from __future__ import annotations

from typing import Any

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.megatron_adapter.training.run_config import RunConfig
from megatron_ext.megatron_adapter.transformer_config import params_dtype, transformer_config
from megatron_ext.plan import LayerStrategy

__all__ = ["ddp_config", "optimizer_config", "run_transformer_config"]


def run_transformer_config(run: RunConfig, strategy: LayerStrategy,
                           **overrides: Any) -> TransformerConfig:
    """The run's TransformerConfig with the degrees of `strategy`."""
    plan = run.plan
    return transformer_config(plan.model, precision=plan.precision, options=run.model,
                              strategy=strategy, pp=plan.pp, fp8=plan.fp8, **overrides)


def ddp_config(run: RunConfig, *, zero: int, **overrides: Any) -> DistributedDataParallelConfig:
    """megatron-core DDP settings every backend uses (gradient dtype, overlap, NaN check)."""
    opt = run.optimizer
    fields: dict[str, Any] = dict(
        grad_reduce_in_fp32=opt.grad_reduce_in_fp32,
        overlap_grad_reduce=opt.overlap_grad_reduce,
        overlap_param_gather=opt.overlap_param_gather,
        use_distributed_optimizer=zero >= 1,
        check_for_nan_in_grad=opt.check_for_nan_in_loss_and_grad,
        bucket_size=opt.ddp_bucket_size,
        # Megatron-LM fills the DDP config by field name: --fp8-param-gather -> fp8_param_gather
        fp8_param_gather=run.plan.fp8 is not None and run.plan.fp8.param_gather,
    )
    fields.update(overrides)
    return DistributedDataParallelConfig(**fields)


def optimizer_config(run: RunConfig, *, use_distributed_optimizer: bool) -> OptimizerConfig:
    opt, precision = run.optimizer, run.plan.precision
    return OptimizerConfig(
        optimizer=opt.optimizer, lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
        sgd_momentum=opt.sgd_momentum, clip_grad=opt.clip_grad,
        bf16=precision == "bf16", fp16=precision == "fp16",
        params_dtype=params_dtype(precision),
        loss_scale=opt.loss_scale, initial_loss_scale=opt.initial_loss_scale,
        min_loss_scale=opt.min_loss_scale, loss_scale_window=opt.loss_scale_window,
        hysteresis=opt.hysteresis, use_distributed_optimizer=use_distributed_optimizer,
        log_num_zeros_in_grad=False,
    )
