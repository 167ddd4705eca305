"""Which backend runs a plan, and which run settings each backend honours: the one place that
decides and builds a backend (backend.py has the contract).

- `flexsp`: plans with a `flexsp` section;
- `stock`: plans megatron-core expresses on its own (`stock_unsupported_reason` is None) and,
  with context parallelism, only with transformer-engine (megatron-core's local attention has
  no context parallelism: "Context parallelism is only supported by TEDotProductAttention");
- `vocab_parallel`: plans with `vocab.mode = vocab_parallel` (the layerwise runtime with the
  vocabulary passes in its 1F1B);
- `layerwise`: every other plan (per-layer strategies, Ulysses, ZeRO-2/3, interleaving, MoE,
  context parallelism without transformer-engine: runtime/ring_attention.py).

`BACKEND_SETTINGS` is the table of run settings x backends: a setting that is on is either
honoured by the chosen backend or refused with one line before any model is built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.ddp import HeteroDDP
from megatron_ext.megatron_adapter.fp8 import install_layer_precision
from megatron_ext.megatron_adapter.training.backend import Backend, BackendName, ChainFormat
from megatron_ext.megatron_adapter.training.flexsp_backend import (
    FlexSPBackend,
    build_flexsp_backend,
)
from megatron_ext.megatron_adapter.training.layerwise_backend import (
    LayerwiseBackend,
    build_layerwise_model,
)
from megatron_ext.megatron_adapter.training.run_config import RunConfig
from megatron_ext.megatron_adapter.training.stock_backend import (
    StockBackend,
    build_stock_backend,
    stock_unsupported_reason,
)
from megatron_ext.megatron_adapter.training.vocab_backend import VocabParallelBackend
from megatron_ext.plan import ParallelPlan
from megatron_ext.runtime.groups import PlanGroups

__all__ = ["BACKENDS", "BACKEND_SETTINGS", "BackendSetting", "backend_for_model", "build_backend",
           "chain_format", "check_backend_settings", "select_backend", "stock_unsupported_reason"]

logger = logging.getLogger(__name__)
BACKEND_CLASSES: dict[BackendName, type[Backend]] = {
    cls.name: cls for cls in (StockBackend, LayerwiseBackend, VocabParallelBackend, FlexSPBackend)}
BACKENDS: tuple[BackendName, ...] = tuple(BACKEND_CLASSES)
_LAYERWISE_FAMILY = ("layerwise", "vocab_parallel")


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendSetting:
    """One run setting and what each backend does with it when it is on."""

    flag: str
    """The Megatron-LM flag (as users write it)."""
    is_on: Callable[[RunConfig], bool]
    """Whether this run turns the setting on."""
    refused_by: dict[str, str]
    """backend -> the fix to print when that backend cannot honour it; absent: honoured."""


BACKEND_SETTINGS: tuple[BackendSetting, ...] = (
    BackendSetting(flag="--overlap-grad-reduce",
                   is_on=lambda r: r.optimizer.overlap_grad_reduce, refused_by={}),
    BackendSetting(flag="--overlap-param-gather",
                   is_on=lambda r: r.optimizer.overlap_param_gather, refused_by={}),
    BackendSetting(flag="--check-for-nan-in-loss-and-grad (on by default)",
                   is_on=lambda r: r.optimizer.check_for_nan_in_loss_and_grad, refused_by={}),
    BackendSetting(flag="--accumulate-allreduce-grads-in-fp32 (default with --bf16)",
                   is_on=lambda r: r.optimizer.grad_reduce_in_fp32, refused_by={}),
    BackendSetting(flag="--ddp-bucket-size",
                   is_on=lambda r: r.optimizer.ddp_bucket_size is not None, refused_by={}),
    BackendSetting(flag="--calculate-per-token-loss",
                   is_on=lambda r: r.optimizer.calculate_per_token_loss, refused_by={}),
    BackendSetting(
        flag="--eod-mask-loss without --calculate-per-token-loss",
        is_on=lambda r: r.data.eod_mask_loss and not r.optimizer.calculate_per_token_loss,
        refused_by=dict.fromkeys(
            ("layerwise", "vocab_parallel", "flexsp"),
            "this backend divides by the global batch's loss tokens; add "
            "--calculate-per-token-loss")),
    BackendSetting(flag="--reset-attention-mask",
                   is_on=lambda r: r.data.reset_attention_mask,
                   refused_by=dict.fromkeys(
                       _LAYERWISE_FAMILY, "the layerwise runtime's attention is causal over the "
                       "whole sample; drop the flag or use a uniform plan")),
    BackendSetting(flag="--fp16", is_on=lambda r: r.plan.precision == "fp16", refused_by={}),
    BackendSetting(flag="--use-rope-scaling",
                   is_on=lambda r: r.plan.model.rope_scaling, refused_by={}),
    BackendSetting(flag="--rotary-seq-len-interpolation-factor",
                   is_on=lambda r: r.model.rotary_seq_len_interpolation_factor is not None,
                   refused_by={}),
    BackendSetting(flag="--rampup-batch-size",
                   is_on=lambda r: r.batch.rampup_batch_size is not None, refused_by={}),
    BackendSetting(flag="--exit-duration-in-mins",
                   is_on=lambda r: r.schedule.exit_duration_in_mins is not None, refused_by={}),
    # MoE models train on the layerwise runtime (select_backend never picks stock for them)
    BackendSetting(flag="--num-experts (a mixture-of-experts model)",
                   is_on=lambda r: r.plan.model.moe is not None,
                   refused_by={"flexsp": "FlexSP plans have dense layers only; drop "
                               "--flexsp or --num-experts",
                               "stock": "MoE models run on the layerwise runtime"}),
    BackendSetting(flag="--fp8-param-gather",
                   is_on=lambda r: r.plan.fp8 is not None and r.plan.fp8.param_gather,
                   refused_by=dict.fromkeys(
                       _LAYERWISE_FAMILY, "the layerwise runtime creates its layers' weights "
                       "in bf16 (no fp8_model_init); drop --fp8-param-gather or use a uniform "
                       "plan")),
    BackendSetting(flag="--attention-dropout other than 0",
                   is_on=lambda r: r.model.attention_dropout != 0,
                   refused_by={"flexsp": "FlexSP attention has no dropout; pass "
                               "--attention-dropout 0"}),
)


def select_backend(run: RunConfig) -> BackendName:
    """The backend that runs this run's plan (see the module docstring). Every backend writes
    and reads one checkpoint format (checkpoint.py), so a checkpoint being loaded does not
    decide it."""
    return plan_backend(run.plan, use_transformer_engine=run.model.use_transformer_engine)


def plan_backend(plan: ParallelPlan, *, use_transformer_engine: bool) -> BackendName:
    """`select_backend` for a plan alone."""
    if plan.flexsp is not None:
        return "flexsp"
    if plan.vocab.mode == "vocab_parallel":
        return "vocab_parallel"
    if stock_unsupported_reason(plan) is not None:
        return "layerwise"
    if plan.layers[0].cp > 1 and not use_transformer_engine:
        return "layerwise"
    if (plan.model.mla is not None and not use_transformer_engine
            and any(s.tp > 1 for s in plan.layers)):
        # megatron-core's local MLA spec loses the RoPE-key gradient over TP and doubles
        # q_layernorm's; the layerwise runtime's MLA layer fixes both (mla_attention.py)
        return "layerwise"
    return "stock"


def chain_format(plan: ParallelPlan, *, use_transformer_engine: bool) -> ChainFormat:
    """How the backend that runs `plan` chains optimizers (checkpoints compare it)."""
    name = plan_backend(plan, use_transformer_engine=use_transformer_engine)
    return BACKEND_CLASSES[name].chain_format


def check_backend_settings(run: RunConfig, backend: BackendName) -> None:
    """One-line PlanError for the first setting this run turns on that `backend` refuses."""
    for setting in BACKEND_SETTINGS:
        fix = setting.refused_by.get(backend)
        if fix is not None and setting.is_on(run):
            raise PlanError(f"{setting.flag} is not supported by the {backend} backend this "
                            f"plan runs on: {fix}")


def build_backend(run: RunConfig, padded_vocab: int, *, eod: int | None = None) -> Backend:
    """The backend `select_backend` picks, after `check_backend_settings`. `eod` (the
    tokenizer's end-of-document id) is needed by FlexSP plans, which cut samples into
    documents."""
    name = select_backend(run)
    check_backend_settings(run, name)
    install_layer_precision(run.plan.fp8)  # the plan's per-layer bf16 choice, if any
    if dist.get_rank() == 0:
        logger.info("backend: %s", name)
    if name == "flexsp":
        assert eod is not None, "FlexSP plans need the tokenizer's eod id"
        return build_flexsp_backend(run, padded_vocab, eod)
    if name == "stock":
        return build_stock_backend(run, padded_vocab)
    chunks, groups, optimizer = build_layerwise_model(run, padded_vocab)
    return backend_for_model(chunks, groups, optimizer,
                             check_nan=run.optimizer.check_for_nan_in_loss_and_grad)


def backend_for_model(chunks: list[HeteroDDP], groups: PlanGroups, optimizer: Any, *,
                      check_nan: bool = False, forward_step_func: Callable[..., Any] | None = None,
                      **vocab_schedule_options: Any) -> LayerwiseBackend:
    """The layerwise-runtime backend (`vocab_parallel` or `layerwise`) of chunks built by
    `build_model` and `build_optimizer`: what training, the parity tests and the benchmarks
    step. `vocab_schedule_options`: extra VocabScheduleOptions fields (vocab_parallel plans)."""
    if groups.plan.vocab.mode == "vocab_parallel":
        return VocabParallelBackend.from_model(
            chunks, groups, optimizer, check_nan=check_nan, forward_step_func=forward_step_func,
            schedule_options=vocab_schedule_options)
    assert not vocab_schedule_options, "schedule options are for vocab_parallel plans"
    return LayerwiseBackend.from_model(chunks, groups, optimizer, check_nan=check_nan,
                                       forward_step_func=forward_step_func)
