"""What megatron_ext's drop-in core attentions share: argument checks and the softmax scale.

Both `SequenceParallelCoreAttention` (attention.py: Ulysses + ring attention for the layerwise
runtime) and `FlexSPCoreAttention` (flexsp/attention.py: Ulysses + packed varlen attention) take
megatron's core-attention constructor arguments, support causal masking without dropout only,
and scale scores by 1/sqrt(head_dim) unless megatron passes a scale.
"""

from __future__ import annotations

import math

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.errors import PlanError

__all__ = ["causal_softmax_scale"]


def causal_softmax_scale(
    config: TransformerConfig,
    *,
    where: str,
    layer_number: int,
    attn_mask_type: AttnMaskType,
    attention_dropout: float | None,
    softmax_scale: float | None,
    mask_types: tuple[AttnMaskType, ...] = (AttnMaskType.causal,),
    allow_layer_scaling: bool = False,
) -> float:
    """Raise PlanError for dropout, a non-causal mask or (unless allowed) query-key layer
    scaling on `where`; return the softmax scale to use."""
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        raise PlanError(f"attention_dropout={dropout} is not supported on {where}; set "
                        "--attention-dropout 0")
    if attn_mask_type not in mask_types:
        raise PlanError(f"attn_mask_type={attn_mask_type} is not supported on {where}; only "
                        f"{', '.join(m.name for m in mask_types)}")
    if config.apply_query_key_layer_scaling and not allow_layer_scaling:
        raise PlanError(f"apply_query_key_layer_scaling is not supported on {where}; drop "
                        "--apply-query-key-layer-scaling")
    head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
    scale = softmax_scale or 1.0 / math.sqrt(head_dim)
    if config.apply_query_key_layer_scaling:
        scale /= layer_number
    return scale
