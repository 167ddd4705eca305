"""Sequence-parallel-capable norms for the local (no TE, no apex) GPT spec, and spec helpers.

Legend: s = sequence, b = micro-batch, h = hidden, tp = tensor-parallel size.

Under sequence parallelism the norms see `[s/tp, b, h]` activations, so each TP rank holds a
partial gradient of the (replicated) norm weight. megatron-core sums those partial grads over
TP in `finalize_model_grads._allreduce_non_tensor_model_parallel_grads`, but only for params
tagged `sequence_parallel=True`. apex `FusedLayerNorm` (fusions/fused_layer_norm.py:116-120)
and TE `TENorm` tag them; the local fallback `WrappedTorchNorm` (transformer/torch_norm.py:32)
instead asserts `not config.sequence_parallel`. `SPLayerNorm` / `SPRMSNorm` are plain torch
norms that tag their params the same way, so the local spec works with SP on CPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = [
    "SPLayerNorm",
    "SPNorm",
    "SPRMSNorm",
    "gpt_block_spec",
    "gpt_layer_spec",
    "have_transformer_engine",
]


def _tag_sequence_parallel(module: torch.nn.Module, sequence_parallel: bool) -> None:
    """Tag every param like apex FusedLayerNorm does (fused_layer_norm.py:119-120)."""
    for param in module.parameters():
        param.sequence_parallel = sequence_parallel


def _check_unsupported(config: TransformerConfig) -> None:
    if config.layernorm_zero_centered_gamma:
        raise ValueError("SPNorm: layernorm_zero_centered_gamma is not supported")
    if config.persist_layer_norm or config.memory_efficient_layer_norm:
        raise ValueError("SPNorm: persist/memory-efficient layer norm need apex or TE")


class SPLayerNorm(torch.nn.LayerNorm):
    """`torch.nn.LayerNorm` whose weight and bias carry `config.sequence_parallel` as a tag.

    Constructor matches the megatron norm protocol (`build_module(spec, config=, hidden_size=,
    eps=)`); extra keyword arguments of that protocol are accepted and ignored.
    """

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused: Any
    ) -> None:
        _check_unsupported(config)
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.config = config
        _tag_sequence_parallel(self, config.sequence_parallel)


class SPRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` whose weight carries `config.sequence_parallel` as a tag."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused: Any
    ) -> None:
        _check_unsupported(config)
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.config = config
        _tag_sequence_parallel(self, config.sequence_parallel)


class SPNorm:
    """Drop-in for `WrappedTorchNorm`: `SPLayerNorm` or `SPRMSNorm` by `config.normalization`."""

    def __new__(  # type: ignore[misc]
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs: Any
    ) -> torch.nn.Module:
        if config.normalization == "LayerNorm":
            return SPLayerNorm(config, hidden_size, eps, **kwargs)
        if config.normalization == "RMSNorm":
            return SPRMSNorm(config, hidden_size, eps, **kwargs)
        raise ValueError(f"SPNorm supports LayerNorm and RMSNorm, got {config.normalization!r}")


def have_transformer_engine() -> bool:
    """True when `transformer_engine` is importable (checked without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def _swap_torch_norm(obj: Any) -> Any:
    """Copy of a spec tree with every `WrappedTorchNorm` replaced by `SPNorm` (inputs untouched)."""
    if obj is WrappedTorchNorm:
        return SPNorm
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            new_value = _swap_torch_norm(value)
            if new_value is not value:
                changes[field.name] = new_value
        return dataclasses.replace(obj, **changes) if changes else obj
    if isinstance(obj, list):
        new_list = [_swap_torch_norm(item) for item in obj]
        return new_list if any(a is not b for a, b in zip(new_list, obj, strict=True)) else obj
    return obj


def gpt_layer_spec(
    config: TransformerConfig, *, use_transformer_engine: bool | None = None,
    moe: bool = False,
) -> ModuleSpec:
    """GPT layer spec: TE spec if TE is importable, else the local spec; `moe`: an MoE layer
    (megatron-core's MoELayer with `config.num_moe_experts` routed experts; SequentialMLP
    experts on the local spec, grouped GEMM with `config.moe_grouped_gemm`).

    With the local spec and `config.sequence_parallel`, the torch norms become `SPNorm`.
    `use_transformer_engine=None` auto-detects TE.
    """
    experts = dict(num_experts=config.num_moe_experts,
                   moe_grouped_gemm=config.moe_grouped_gemm) if moe else {}
    if use_transformer_engine is None:
        use_transformer_engine = have_transformer_engine()
    if use_transformer_engine:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=config.qk_layernorm,
            multi_latent_attention=config.multi_latent_attention, **experts,
        )
    spec = get_gpt_layer_local_spec(
        **experts,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        normalization=config.normalization,
    )
    return _swap_torch_norm(spec) if config.sequence_parallel else spec


def gpt_block_spec(
    config: TransformerConfig,
    *,
    use_transformer_engine: bool | None = None,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """This stage's GPT block spec (layer slice + final norm) via `get_gpt_decoder_block_spec`.

    With the local spec and SP, both the layer norms and the block's `final_layernorm`
    (`TransformerBlockSubmodules.layer_norm`) become `SPNorm`
    (megatron/core/models/gpt/gpt_layer_specs.py).
    """
    if use_transformer_engine is None:
        use_transformer_engine = have_transformer_engine()
    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=use_transformer_engine,
        normalization=config.normalization,
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )
    if use_transformer_engine or not config.sequence_parallel:
        return block
    return _swap_torch_norm(block)
