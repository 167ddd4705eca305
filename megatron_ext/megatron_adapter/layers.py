"""Per-layer megatron-core configs and specs: each layer gets its own degrees and process groups.

megatron-core reads degrees (`tensor_model_parallel_size`, `sequence_parallel`, recompute) from
the config a module receives and its groups from its `pg_collection`, so every layer gets a
`dataclasses.replace` of the base config and the collection of its layout. Specs are stock:
the TE spec when transformer_engine imports, the local spec otherwise (`sp_norm.gpt_layer_spec`,
SP-capable norms); only the core attention of context-parallel / Ulysses layers is swapped
(`attention.SequenceParallelCoreAttention`; with TE, CP-only layers keep TE's CP attention).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.errors import PlanError
from megatron_ext.geometry.activation import ActivationLayout
from megatron_ext.megatron_adapter.attention import SequenceParallelCoreAttention
from megatron_ext.megatron_adapter.compat import router_weighs_the_token_block
from megatron_ext.megatron_adapter.mla_attention import layer_group_mla_layer
from megatron_ext.megatron_adapter.sp_norm import (
    SPNorm,
    gpt_layer_spec,
    have_transformer_engine,
)
from megatron_ext.plan import LayerStrategy, ParallelPlan

__all__ = [
    "check_config",
    "final_norm_spec",
    "layer_config",
    "layer_spec",
    "vocab_config",
]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_config(plan: ParallelPlan, config: TransformerConfig) -> None:
    """One-line PlanError when the model config disagrees with the plan's model."""
    model = plan.model
    pairs = {
        "num_layers": model.num_layers, "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.num_query_groups or model.num_attention_heads,
    }
    for name, expected in pairs.items():
        got = getattr(config, name) or (model.num_attention_heads
                                        if name == "num_query_groups" else None)
        if got != expected:
            raise PlanError(
                f"model config {name}={got} but the plan was made for model.{name}={expected}; "
                "use the plan's model or re-plan"
            )


def _plain_pipeline(config: TransformerConfig, **extra: Any) -> TransformerConfig:
    """No pipeline fields: layers get global layer numbers directly (offset 0)."""
    return dataclasses.replace(
        config, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        pipeline_model_parallel_layout=None, num_layers_in_first_pipeline_stage=None,
        num_layers_in_last_pipeline_stage=None, account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False, **extra,
    )


def _moe_layer_fields(base: TransformerConfig, strategy: LayerStrategy) -> dict[str, Any]:
    """Expert degrees of the layer, and its router-loss coefficients for per-token loss.

    With `calculate_per_token_loss` (always, in this runtime) megatron-core's router attaches
    each rank's load-balancing loss times the rank's own token count (router.py:456-463), and
    the z-loss with its coefficient divided by the token-block group (tp x cp) times the
    rank's tokens (router.py:480-494). The ranks of one token block (tp x Ulysses x cp) hold
    parts of the same loss and their router grads are summed, so the block's loss would count
    with 1/(tp x cp) of its tokens. Multiplying the coefficients by the size of the group the
    counts are summed over (the block; the stage for global_aux_loss) weights every block's loss
    by all its tokens: the value a single process computes for the same token block, whatever
    tp / cp / Ulysses the layer has. Logged values divide the coefficient out again.
    megatron-core 0.19 multiplies by the token-block group itself
    (`compat.router_weighs_the_token_block`): there only global_aux_loss keeps a factor, the
    stage over the block.
    """
    if base.num_moe_experts is None:
        return {}
    block = strategy.tp * strategy.cp * strategy.ulysses
    done_by_router = block if router_weighs_the_token_block() else 1

    def scale(kind: str) -> int:
        return (strategy.width if kind == "global_aux_loss" else block) // done_by_router

    kinds, coeffs = base.moe_router_load_balancing_type, base.moe_aux_loss_coeff
    if isinstance(kinds, list):
        coeffs = [c * scale(k) for k, c in zip(kinds, coeffs, strict=True)]
    else:
        coeffs = coeffs * scale(kinds)
    z_loss = (base.moe_z_loss_coeff * (block // done_by_router) if base.moe_z_loss_coeff
              else base.moe_z_loss_coeff)
    return dict(expert_model_parallel_size=strategy.ep,
                expert_tensor_parallel_size=strategy.expert_tp,
                moe_aux_loss_coeff=coeffs, moe_z_loss_coeff=z_loss)


def layer_config(base: TransformerConfig, strategy: LayerStrategy) -> TransformerConfig:
    """Config of one layer: its TP/SP/CP degrees, selective recompute (full is block-level) and,
    in MoE models, its expert degrees (ep, etp)."""
    selective = strategy.recompute == "selective"
    return _plain_pipeline(
        base, tensor_model_parallel_size=strategy.tp, sequence_parallel=strategy.sp,
        context_parallel_size=strategy.cp, recompute_method=None, recompute_num_layers=None,
        recompute_granularity="selective" if selective else None,
        recompute_modules=["core_attn"] if selective else base.recompute_modules,
        **_moe_layer_fields(base, strategy),
    )


def vocab_config(base: TransformerConfig, layout: ActivationLayout, pp: int) -> TransformerConfig:
    """Config of the embedding / output layer / final norm on a stage (vocabulary layout)."""
    return dataclasses.replace(
        _plain_pipeline(base, tensor_model_parallel_size=layout.tp, sequence_parallel=layout.sp,
                        context_parallel_size=1, recompute_granularity=None,
                        recompute_method=None, recompute_num_layers=None),
        pipeline_model_parallel_size=pp,
    )


def layer_spec(config: TransformerConfig, strategy: LayerStrategy,
               ulysses_group: dist.ProcessGroup, *, use_te: bool | None = None,
               moe: bool = False) -> ModuleSpec:
    """Stock GPT layer spec (`moe`: with megatron-core's MoELayer); CP/Ulysses layers get
    `SequenceParallelCoreAttention`; MLA layers without Transformer Engine
    `LayerGroupMLASelfAttention`."""
    use_te = have_transformer_engine() if use_te is None else use_te
    spec = gpt_layer_spec(config, use_transformer_engine=use_te, moe=moe)
    if config.multi_latent_attention and not use_te:  # latents gathered over the layer's group
        spec = layer_group_mla_layer(spec)
    if strategy.ulysses == 1 and (strategy.cp == 1 or use_te):
        return spec
    core = ModuleSpec(module=SequenceParallelCoreAttention,
                      params={"ulysses_group": ulysses_group})
    attn = spec.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules,
                                                                    core_attention=core))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                    self_attention=attn))


def final_norm_spec(*, use_te: bool | None = None) -> Any:
    """Norm class of the block's final layer norm (SP-capable on the local path)."""
    if have_transformer_engine() if use_te is None else use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return SPNorm
