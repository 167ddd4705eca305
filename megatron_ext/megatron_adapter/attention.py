"""Core attention for context-parallel and Ulysses layers: a drop-in for `DotProductAttention`.

Legend: s = sequence held after the layer's SP all-gather (s_global / (cp * ulysses)), b = batch,
n = query heads per TP rank, g = key/value heads per TP rank, d = head dim, u = Ulysses degree.

megatron-core 0.16.1's local `DotProductAttention` asserts `context_parallel_size == 1`
(dot_product_attention.py:58) and CP is otherwise TE-only. This module keeps Megatron's
core-attention interface (constructor kwargs from `SelfAttention`, forward(query, key, value,
attention_mask, attn_mask_type=..., ...) -> `[s, b, n*d]`) and runs
Ulysses all-to-all over `ulysses_group` (heads <-> sequence) around pure-torch ring attention
over the layer's cp group (`runtime/ring_attention.py`). Causal masking only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.megatron_adapter.core_attention_checks import causal_softmax_scale
from megatron_ext.runtime.ring_attention import ring_attention
from megatron_ext.runtime.ulysses import heads_to_seq, seq_to_heads

__all__ = ["SequenceParallelCoreAttention"]


class SequenceParallelCoreAttention(MegatronModule):
    """Ulysses (over `ulysses_group`) + ring attention (over `pg_collection.cp`), causal."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        *,
        ulysses_group: dist.ProcessGroup,
        **_unused: Any,
    ) -> None:
        super().__init__(config=config)
        self.softmax_scale = causal_softmax_scale(  # PlanError is a ValueError
            config, where="context-parallel / Ulysses layers without Transformer Engine",
            layer_number=layer_number, attn_mask_type=attn_mask_type,
            attention_dropout=attention_dropout, softmax_scale=softmax_scale)
        assert pg_collection is not None
        # MegatronModule.sharded_state_dict reads parallel_state's tp group without it
        # (module.py:82), which the layerwise runtime never initialises
        self.tp_group = pg_collection.tp
        self.cp_group = pg_collection.cp
        self.ulysses_group = ulysses_group

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        assert attention_bias is None and packed_seq_params is None
        s, b = query.shape[:2]  # query: [s, b, n, d]; key, value: [s, b, g, d]
        q, k, v = (seq_to_heads(t, self.ulysses_group) for t in (query, key, value))
        # q: [s*u, b, n/u, d], k, v: [s*u, b, g/u, d]
        out = ring_attention(q, k, v, group=self.cp_group, softmax_scale=self.softmax_scale)
        out = heads_to_seq(out, self.ulysses_group)  # [s, b, n, d]
        return out.reshape(s, b, -1)  # [s, b, n*d]
