"""megatron-core glue for FlexSP: a core-attention submodule doing Ulysses + packed attention.

Legend: t = this rank's tokens of its group's packed stream (batch dim b = 1), n = query heads,
g = kv heads, d = head dim.

Megatron's SelfAttention computes q/k/v for the rank's own tokens, applies RoPE, and calls
`core_attention(query, key, value, mask, packed_seq_params=...)`. `FlexSPCoreAttention` replaces
the local DotProductAttention there (which rejects packed input): it reads the step's Ulysses
group from `packed_seq_params.cp_group` and the group's sequence boundaries from
`cu_seqlens_q`, and runs `runtime.flexsp.attention.ulysses_varlen_attention`. The params use
qkv_format "sbhd" so megatron keeps the [t, 1, ...] layout and applies RoPE row by row: pass
`rotary_pos_emb = freqs[position_ids]` ([t, 1, 1, rot_dim]) so positions restart per sequence.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.core_attention_checks import causal_softmax_scale
from megatron_ext.planner.flexsp.step_plan import token_split
from megatron_ext.runtime.flexsp.attention import ulysses_varlen_attention
from megatron_ext.runtime.flexsp.dispatch import RankMicroBatch

__all__ = ["FlexSPCoreAttention", "flexsp_layer_spec", "flexsp_packed_seq_params"]


class FlexSPCoreAttention(MegatronModule):
    """Drop-in `core_attention` for the local GPT layer spec (no TP; FlexSP replaces it)."""

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
    ) -> None:
        super().__init__(config=config)
        tp = pg_collection.tp.size() if pg_collection is not None and pg_collection.tp else 1
        if tp != 1 or config.context_parallel_size != 1:
            raise PlanError(
                f"FlexSP attention runs with tensor_model_parallel_size=1 and "
                f"context_parallel_size=1, got tp={tp} cp={config.context_parallel_size}"
            )
        self.softmax_scale = causal_softmax_scale(
            config, where="FlexSP attention", layer_number=layer_number,
            attn_mask_type=attn_mask_type, attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            mask_types=(AttnMaskType.causal, AttnMaskType.padding_causal),
            allow_layer_scaling=True)

    def forward(
        self,
        query: torch.Tensor,  # [t, 1, n, d]
        key: torch.Tensor,  # [t, 1, g, d]
        value: torch.Tensor,  # [t, 1, g, d]
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:  # [t, 1, n*d]
        if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None:
            raise PlanError("FlexSP attention needs packed_seq_params from "
                            "flexsp_packed_seq_params(view, group)")
        if query.shape[1] != 1 or attention_bias is not None:
            raise PlanError("FlexSP attention takes packed tokens (batch 1) and no bias")
        group = packed_seq_params.cp_group
        degree = 1 if group is None else dist.get_world_size(group)
        cu = [int(x) for x in packed_seq_params.cu_seqlens_q.tolist()]
        counts = [b - a for a, b in token_split(cu[-1], degree)]
        t, _, n, d = query.shape
        out = ulysses_varlen_attention(
            query.squeeze(1), key.squeeze(1), value.squeeze(1),  # [t, n|g, d]
            group=group, token_counts=counts, cu_seqlens=cu, softmax_scale=self.softmax_scale)
        return out.reshape(t, 1, n * d)  # [t, 1, n*d]


def flexsp_packed_seq_params(view: RankMicroBatch, group: dist.ProcessGroup | None,
                             device: torch.device | None = None) -> PackedSeqParams:
    """Packed-sequence params carrying one micro-batch's group and sequence boundaries."""
    cu = torch.tensor(view.cu_seqlens, dtype=torch.int32, device=device)
    max_len = max(b - a for a, b in zip(view.cu_seqlens[:-1], view.cu_seqlens[1:]))
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max_len, max_seqlen_kv=max_len,
                           cp_group=group, local_cp_size=view.degree)


def flexsp_layer_spec(**local_spec_kwargs: object) -> ModuleSpec:
    """`get_gpt_layer_local_spec(...)` with FlexSPCoreAttention as the core attention."""
    spec = get_gpt_layer_local_spec(**local_spec_kwargs)  # type: ignore[arg-type]
    attn = spec.submodules.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=FlexSPCoreAttention)
    layer_sub = dataclasses.replace(spec.submodules,
                                    self_attention=dataclasses.replace(attn, submodules=attn_sub))
    return dataclasses.replace(spec, submodules=layer_sub)
