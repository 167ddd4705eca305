"""TransformerConfig and OptimizerConfig from Megatron-LM flags and a ParallelPlan.

The model shape comes from `plan.model` (which `plan_from_megatron_args` fills from the
`--num-layers ...` flags or the plan file), the parallel degrees from the plan's layer strategy,
everything else (dropout, init, fusions, precision, optimizer) from the flags, with Megatron-LM's
defaults where a flag is absent.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.megatron_adapter.layers import model_fields
from megatron_ext.plan import LayerStrategy, ParallelPlan


def _flag(args: argparse.Namespace, name: str, default: Any) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def on_cpu(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "cpu", False)) or not torch.cuda.is_available()


def _have_apex_wgrad_kernel() -> bool:
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def fusion_fields(args: argparse.Namespace, swiglu: bool) -> dict[str, bool]:
    """Megatron-LM's fusion switches (on unless --no-*-fusion); all off on CPU, where the fused
    kernels do not exist, and gradient-accumulation fusion off without apex's kernel."""
    if on_cpu(args):
        return dict.fromkeys(("masked_softmax_fusion", "bias_activation_fusion",
                              "bias_dropout_fusion", "apply_rope_fusion",
                              "gradient_accumulation_fusion"), False)
    return {
        "masked_softmax_fusion": bool(_flag(args, "masked_softmax_fusion", True)),
        "bias_activation_fusion": bool(
            _flag(args, "bias_swiglu_fusion" if swiglu else "bias_gelu_fusion", True)),
        "bias_dropout_fusion": bool(_flag(args, "bias_dropout_fusion", True)),
        "apply_rope_fusion": bool(_flag(args, "apply_rope_fusion", True)),
        "gradient_accumulation_fusion": bool(_flag(args, "gradient_accumulation_fusion", True))
        and _have_apex_wgrad_kernel(),
    }


def params_dtype(plan: ParallelPlan) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan.precision]


def padded_vocab_size(vocab_size: int, args: argparse.Namespace, tp: int) -> int:
    """Megatron-LM's padding: round up to a multiple of make_vocab_size_divisible_by * tp."""
    multiple = _flag(args, "make_vocab_size_divisible_by", 128) * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def recompute_fields(strategy: LayerStrategy) -> dict[str, Any]:
    if strategy.recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}
    if strategy.recompute == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": None}


def transformer_config(
    args: argparse.Namespace, plan: ParallelPlan, strategy: LayerStrategy, **overrides: Any
) -> TransformerConfig:
    """A TransformerConfig for layers of `strategy` (the stock path passes the single strategy)."""
    model = plan.model
    dtype = params_dtype(plan)
    swiglu = model.activation == "swiglu"
    fields: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization=model.normalization,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=model.add_bias_linear,
        **model_fields(model),  # q/k/v bias, q/k norm, norm epsilon: the plan's model
        hidden_dropout=_flag(args, "hidden_dropout", 0.1),
        attention_dropout=_flag(args, "attention_dropout", 0.1),
        init_method_std=_flag(args, "init_method_std", 0.02),
        apply_query_key_layer_scaling=bool(_flag(args, "apply_query_key_layer_scaling", False)),
        attention_softmax_in_fp32=bool(_flag(args, "attention_softmax_in_fp32", False)),
        tensor_model_parallel_size=strategy.tp,
        pipeline_model_parallel_size=plan.pp,
        context_parallel_size=strategy.cp,
        sequence_parallel=strategy.sp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=plan.precision == "bf16",
        fp16=plan.precision == "fp16",
        use_cpu_initialization=bool(_flag(args, "use_cpu_initialization", False))
        or on_cpu(args),
        deallocate_pipeline_outputs=True,
        **fusion_fields(args, swiglu),
        **recompute_fields(strategy),
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def optimizer_config(args: argparse.Namespace, plan: ParallelPlan, *,
                     use_distributed_optimizer: bool) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=_flag(args, "optimizer", "adam"),
        lr=args.lr,
        min_lr=_flag(args, "min_lr", 0.0),
        weight_decay=_flag(args, "weight_decay", 0.01),
        adam_beta1=_flag(args, "adam_beta1", 0.9),
        adam_beta2=_flag(args, "adam_beta2", 0.999),
        adam_eps=_flag(args, "adam_eps", 1e-8),
        sgd_momentum=_flag(args, "sgd_momentum", 0.9),
        clip_grad=_flag(args, "clip_grad", 1.0),
        bf16=plan.precision == "bf16",
        fp16=plan.precision == "fp16",
        params_dtype=params_dtype(plan),
        loss_scale=getattr(args, "loss_scale", None),
        initial_loss_scale=_flag(args, "initial_loss_scale", 2**32),
        min_loss_scale=_flag(args, "min_loss_scale", 1.0),
        loss_scale_window=_flag(args, "loss_scale_window", 1000),
        hysteresis=_flag(args, "hysteresis", 2),
        use_distributed_optimizer=use_distributed_optimizer,
        log_num_zeros_in_grad=False,
    )
