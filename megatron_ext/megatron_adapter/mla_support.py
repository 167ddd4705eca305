"""What the layerwise runtime needs of a multi-latent attention (MLA) plan, checked before any
process group: one-line PlanErrors for what megatron-core's MLA cannot build on this install.

Without Transformer Engine the layers use megatron-core's local MLA spec
(models/gpt/gpt_layer_specs.py:366-391): the latent down projections are column-parallel
(multi_latent_attention.py:404-417, :590-615), so tp must divide q_lora_rank and
kv_lora_rank + qk_pos_emb_head_dim, and core attention is the local `DotProductAttention`
(the `mla_local_attention` CPU patch), which has no context parallelism. With Transformer
Engine the down projections are replicated and CP runs in TE's attention (p2p).
"""

from __future__ import annotations

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.sp_norm import have_transformer_engine
from megatron_ext.plan import ParallelPlan

__all__ = ["check_mla_support"]


def check_mla_support(plan: ParallelPlan, *, use_te: bool | None = None) -> None:
    mla = plan.model.mla
    if mla is None:
        return
    if have_transformer_engine() if use_te is None else use_te:
        return
    widths = {"q_lora_rank": mla.q_lora_rank or 0,
              "kv_lora_rank + qk_pos_emb_head_dim": mla.kv_lora_rank + mla.qk_pos_emb_head_dim}
    for idx, s in enumerate(plan.layers):
        if s.cp > 1:
            raise PlanError(f"layers[{idx}].cp={s.cp} with model.mla: context parallelism for "
                            "multi-latent attention runs in Transformer Engine's attention, "
                            "which is not installed here; use cp=1 or install transformer-engine")
        for name, width in widths.items():
            if width % s.tp:
                raise PlanError(f"layers[{idx}].tp={s.tp} does not divide model.mla {name}="
                                f"{width}: without Transformer Engine megatron-core splits the "
                                "latent down projection over tp; use a tp that divides it")
