"""ModelSpec -> megatron-core TransformerConfig and GPTModel arguments: the one mapping.

Every backend (stock GPTModel, the layerwise runtime, FlexSP), the profilers and the tests build
their TransformerConfig with `transformer_config` and their GPTModel position arguments with
`gpt_model_kwargs`. A new ModelSpec field that changes the model (rotary base, qkv bias,
qk-layernorm, ...) is mapped here, once.

`ModelOptions` holds what the plan's ModelSpec does not carry (dropout, init, fusions, RoPE
interpolation, ...); its defaults are CPU-safe (no dropout, no fused kernels), and the training path
sets every field from Megatron-LM's flags (training/run_config.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_ext.plan import LayerStrategy
from megatron_ext.specs import FP8Spec, ModelSpec

__all__ = ["ModelOptions", "fp8_fields", "gpt_model_kwargs", "mla_fields", "moe_fields",
           "params_dtype", "transformer_config"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelOptions:
    """TransformerConfig / GPTModel settings the plan's ModelSpec does not carry.

    Defaults are the library's CPU-safe ones (no dropout, no fused kernels) for code that builds
    a model without flags; the training path sets every field from the flags (Megatron-LM's
    defaults there: dropout 0.1, fusions on where the kernels exist)."""

    hidden_dropout: float = 0.0
    """--hidden-dropout."""
    attention_dropout: float = 0.0
    """--attention-dropout."""
    init_method_std: float = 0.02
    """--init-method-std."""
    apply_query_key_layer_scaling: bool = False
    """--apply-query-key-layer-scaling."""
    attention_softmax_in_fp32: bool = False
    """--attention-softmax-in-fp32."""
    rotary_seq_len_interpolation_factor: int | None = None
    """--rotary-seq-len-interpolation-factor (linear position interpolation)."""
    make_vocab_size_divisible_by: int = 128
    """--make-vocab-size-divisible-by (per vocabulary shard)."""
    use_transformer_engine: bool = False
    """--transformer-impl transformer_engine, and transformer-engine imports."""
    use_cpu_initialization: bool = True
    """--use-cpu-initialization (always on CPU)."""
    masked_softmax_fusion: bool = False
    """Fused kernels: Megatron-LM's --no-*-fusion switches; off on CPU (no kernels there)."""
    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False
    apply_rope_fusion: bool = False
    gradient_accumulation_fusion: bool = False
    """Also needs apex's fused_weight_gradient_mlp_cuda."""
    moe_token_dispatcher_type: str = "allgather"
    """MoE layers: --moe-token-dispatcher-type (allgather, Megatron-LM's default, or alltoall;
    flex needs DeepEP/HybridEP kernels)."""
    moe_grouped_gemm: bool = False
    """MoE layers: --moe-grouped-gemm (needs Transformer Engine or the grouped_gemm package)."""
    moe_router_dtype: str | None = None
    """MoE layers: --moe-router-dtype (fp32 / fp64 router computation; None = input dtype)."""
    moe_input_jitter_eps: float | None = None
    """MoE layers: --moe-input-jitter-eps (multiplicative noise on the router input)."""
    moe_pad_expert_input_to_capacity: bool = False
    """MoE layers: --moe-pad-expert-input-to-capacity."""


def params_dtype(precision: str) -> torch.dtype:
    return _DTYPES[precision]


_ROUTER_DTYPES = {None: None, "fp32": "fp32", "fp64": "fp64"}


def moe_fields(model: ModelSpec, options: ModelOptions, strategy: LayerStrategy
               ) -> dict[str, Any]:
    """TransformerConfig fields of `model.moe` (none for a dense model): Megatron-LM's
    --num-experts family, with the expert degrees of `strategy` (ep, etp)."""
    moe = model.moe
    if moe is None:
        return {}
    freq = moe.layer_freq if isinstance(moe.layer_freq, int) else list(moe.layer_freq)
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=moe.expert_ffn_hidden_size(model),
        moe_shared_expert_intermediate_size=moe.shared_expert_intermediate_size or None,
        moe_layer_freq=freq,
        moe_router_load_balancing_type=moe.router_load_balancing_type,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        moe_router_score_function=moe.router_score_function,
        moe_router_pre_softmax=moe.router_pre_softmax,
        moe_expert_capacity_factor=moe.capacity_factor or None,
        moe_token_dispatcher_type=options.moe_token_dispatcher_type,
        moe_grouped_gemm=options.moe_grouped_gemm,
        moe_router_dtype=_ROUTER_DTYPES[options.moe_router_dtype],
        moe_input_jitter_eps=options.moe_input_jitter_eps,
        moe_pad_expert_input_to_capacity=options.moe_pad_expert_input_to_capacity,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_router_topk_scaling_factor=moe.router_topk_scaling_factor or None,
        moe_router_num_groups=moe.router_num_groups or None,
        moe_router_group_topk=moe.router_group_topk or None,
        moe_router_enable_expert_bias=moe.router_enable_expert_bias,
        moe_router_bias_update_rate=moe.router_bias_update_rate,
        moe_token_drop_policy=moe.token_drop_policy,
        expert_model_parallel_size=strategy.ep,
        expert_tensor_parallel_size=strategy.expert_tp,
    )


def fp8_fields(fp8: FP8Spec | None, *, fp8_interval: int = 1) -> dict[str, Any]:
    """TransformerConfig's FP8 / FP4 fields as Megatron-LM's core_transformer_config_from_args
    sets them for the same flags (arguments.py:1306-1331 at core_v0.16.1: every args attribute
    named like a config field, then fp8_param = args.fp8_param_gather); without FP8 the flags'
    defaults. fp8_dot_product_attention, fp8_multi_head_attention and tp_only_amax_red have no
    flag and keep the dataclass default (False) in both; --fp8-interval has no effect in
    Transformer Engine >= 1.8 and is passed as given."""
    f = fp8 or FP8Spec(format="e4m3")  # the flags' defaults
    return dict(
        fp8=fp8.format if fp8 is not None else None,
        fp8_recipe=f.recipe,
        fp8_margin=f.margin,
        fp8_interval=fp8_interval,
        fp8_amax_history_len=f.amax_history_len,
        fp8_amax_compute_algo=f.amax_compute_algo,
        fp8_wgrad=f.wgrad,
        fp8_param=f.param_gather if fp8 is not None else False,
        first_last_layers_bf16=f.first_last_layers_bf16,
        num_layers_at_start_in_bf16=f.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=f.num_layers_at_end_in_bf16,
        fp4=None,
        fp4_recipe="nvfp4",
        fp4_param=False,
        fp8_quantizer_factory=None,  # --fp8-quantizer-factory / --fp4-quantizer-factory are
        fp4_quantizer_factory=None,  # refused (flags/catalog.py), so their default
    )


def mla_fields(model: ModelSpec) -> dict[str, Any]:
    """MLATransformerConfig fields of `model.mla` (none for standard attention), as Megatron-LM
    core_v0.16.1's core_transformer_config_from_args fills them from the --*-lora-rank / head-dim
    / YaRN flags; beta_fast, beta_slow and original_max_position_embeddings have no flag and keep
    MLATransformerConfig's defaults."""
    mla = model.mla
    if mla is None:
        return {}
    return dict(
        multi_latent_attention=True, q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank, qk_head_dim=mla.qk_head_dim,
        qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim, v_head_dim=mla.v_head_dim,
        rope_type=mla.rope_type, rotary_base=model.rotary_base,
        rotary_percent=model.rotary_percent, rotary_scaling_factor=mla.rotary_scaling_factor,
        mscale=mla.mscale, mscale_all_dim=mla.mscale_all_dim,
    )


def _recompute_fields(strategy: LayerStrategy) -> dict[str, Any]:
    if strategy.recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}
    if strategy.recompute == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": None}


def transformer_config(
    model: ModelSpec,
    *,
    precision: str = "fp32",
    options: ModelOptions | None = None,
    strategy: LayerStrategy | None = None,
    pp: int = 1,
    fp8: FP8Spec | None = None,
    **overrides: Any,
) -> TransformerConfig:
    """The TransformerConfig of `model` with the degrees of `strategy` (stock path: the plan's
    one strategy; the layerwise runtime replaces them per layer) on `pp` stages; `fp8` the
    plan's FP8 training (fp8_fields)."""
    options = options or ModelOptions()
    strategy = strategy or LayerStrategy()
    dtype = _DTYPES[precision]
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
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        layernorm_epsilon=model.norm_epsilon,
        hidden_dropout=options.hidden_dropout,
        attention_dropout=options.attention_dropout,
        init_method_std=options.init_method_std,
        apply_query_key_layer_scaling=options.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=options.attention_softmax_in_fp32,
        tensor_model_parallel_size=strategy.tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=strategy.cp,
        sequence_parallel=strategy.sp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu_initialization=options.use_cpu_initialization or not torch.cuda.is_available(),
        deallocate_pipeline_outputs=True,
        masked_softmax_fusion=options.masked_softmax_fusion,
        bias_activation_fusion=options.bias_activation_fusion,
        bias_dropout_fusion=options.bias_dropout_fusion,
        apply_rope_fusion=options.apply_rope_fusion,
        gradient_accumulation_fusion=options.gradient_accumulation_fusion,
        persist_layer_norm=False,
        **_recompute_fields(strategy),
        **moe_fields(model, options, strategy),
        **fp8_fields(fp8),
        **mla_fields(model),
    )
    fields.update(overrides)
    return (TransformerConfig if model.mla is None else MLATransformerConfig)(**fields)


def gpt_model_kwargs(model: ModelSpec, options: ModelOptions | None = None) -> dict[str, Any]:
    """GPTModel constructor arguments for positions and embeddings (same for every backend)."""
    options = options or ModelOptions()
    return dict(
        max_sequence_length=model.max_position_embeddings,
        share_embeddings_and_output_weights=model.tied_embeddings,
        position_embedding_type=model.position_embedding,
        rotary_percent=model.rotary_percent,
        rotary_base=model.rotary_base,
        rope_scaling=model.rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
        seq_len_interpolation_factor=options.rotary_seq_len_interpolation_factor,
    )
