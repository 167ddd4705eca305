"""Megatron-LM's multi-latent attention flags: parsing, the rules around them, the plan's MLASpec.

Names, dests and defaults follow Megatron-LM core_v0.16.1 `megatron/training/arguments.py`:
`--multi-latent-attention` (TransformerConfig-generated), `_add_mla_args` (`--q-lora-rank`,
`--kv-lora-rank`, `--qk-head-dim`, `--qk-pos-emb-head-dim`, `--v-head-dim`,
`--rotary-scaling-factor`, `--mscale`, `--mscale-all-dim`) and `--rope-type` (None: MLA takes
MLATransformerConfig's yarn, arguments.py:1353-1358). They become the plan's `model.mla`
(specs.MLASpec). Nothing here imports torch or megatron.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_ext.errors import PlanError
from megatron_ext.flags.types import positive_int
from megatron_ext.specs import MLASpec

MLA_ONLY = ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
            "--v-head-dim", "--rotary-scaling-factor", "--mscale", "--mscale-all-dim")
"""Flags only MLA layers read: without --multi-latent-attention Megatron-LM ignores them."""

_SPEC_FLAG = {
    "q_lora_rank": "--q-lora-rank", "kv_lora_rank": "--kv-lora-rank",
    "qk_head_dim": "--qk-head-dim", "qk_pos_emb_head_dim": "--qk-pos-emb-head-dim",
    "v_head_dim": "--v-head-dim", "rope_type": "--rope-type",
    "rotary_scaling_factor": "--rotary-scaling-factor", "mscale": "--mscale",
    "mscale_all_dim": "--mscale-all-dim",
}
"""MLASpec field -> the Megatron-LM flag that sets it."""


def add_mla_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-latent attention (the plan's model.mla)")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek-V2/V3 multi-latent attention instead of multi-head / GQA")
    g.add_argument("--q-lora-rank", type=positive_int, default=None,
                   help="rank of the query compression; absent: no query compression")
    g.add_argument("--kv-lora-rank", type=positive_int, default=32)
    g.add_argument("--qk-head-dim", type=positive_int, default=128)
    g.add_argument("--qk-pos-emb-head-dim", type=positive_int, default=64)
    g.add_argument("--v-head-dim", type=positive_int, default=128)
    g.add_argument("--rope-type", type=str, default=None, choices=["rope", "yarn"],
                   help="MLA's RoPE; default yarn (standard attention: rope only)")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="YaRN scaling factor of MLA's RoPE")
    g.add_argument("--mscale", type=float, default=1.0)
    g.add_argument("--mscale-all-dim", type=float, default=0.0)


def check_mla_args(ns: argparse.Namespace) -> None:
    """Megatron-LM core_v0.16.1's MLA rules as one-line errors, before any process group."""
    explicit: set[str] = getattr(ns, "explicit_args", set())
    if not ns.multi_latent_attention:
        given = [f for f in MLA_ONLY if f[2:].replace("-", "_") in explicit]
        if given:
            raise PlanError(f"{given[0]} is read only by multi-latent attention; add "
                            "--multi-latent-attention or drop it")
        if ns.rope_type not in (None, "rope"):
            raise PlanError(f"--rope-type {ns.rope_type}: standard attention supports only "
                            "rope (Megatron-LM asserts it); use --multi-latent-attention or "
                            "drop it")
        return
    if ns.group_query_attention:  # arguments.py:1265-1266
        raise PlanError("--group-query-attention with --multi-latent-attention: Megatron-LM "
                        "refuses the two together; drop --group-query-attention")
    rope_type = ns.rope_type or "yarn"
    if rope_type == "rope" and getattr(ns, "apply_rope_fusion", False):
        # MLATransformerConfig.__post_init__ (transformer_config.py:2068-2069)
        raise PlanError("--rope-type rope with --multi-latent-attention needs --no-rope-fusion: "
                        "megatron-core's fused MLA RoPE supports yarn only")
    tp = ns.tensor_model_parallel_size
    heads = ns.num_attention_heads
    if tp is not None and heads is not None and heads % tp:
        raise PlanError(f"--tensor-model-parallel-size={tp} does not divide "
                        f"--num-attention-heads={heads}: multi-latent attention splits its "
                        "heads over tensor parallelism; use a tp that divides the heads")
    try:
        mla_from_args(ns)
    except PlanError as err:
        raise PlanError(f"these Megatron MLA flags give an invalid model: {err}") from None


def mla_from_args(ns: argparse.Namespace) -> MLASpec | None:
    """The plan's model.mla from a namespace; None without --multi-latent-attention."""
    if not ns.multi_latent_attention:
        return None
    return MLASpec(
        q_lora_rank=ns.q_lora_rank, kv_lora_rank=ns.kv_lora_rank, qk_head_dim=ns.qk_head_dim,
        qk_pos_emb_head_dim=ns.qk_pos_emb_head_dim, v_head_dim=ns.v_head_dim,
        rope_type=ns.rope_type or "yarn", rotary_scaling_factor=ns.rotary_scaling_factor,
        mscale=ns.mscale, mscale_all_dim=ns.mscale_all_dim,
    )


def mla_values(mla: MLASpec | None) -> dict[str, Any]:
    """Megatron-LM dests for a plan's model.mla (None: flag absent). The shape flags are always
    printed (Megatron-LM's MLA recipes spell them out); the YaRN ones only off their default;
    --no-rope-fusion with plain RoPE, which megatron-core's MLA requires."""
    keys = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
            "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "apply_rope_fusion",
            "rotary_scaling_factor", "mscale", "mscale_all_dim")
    if mla is None:
        return dict.fromkeys(keys)
    return {
        "multi_latent_attention": True, "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank, "qk_head_dim": mla.qk_head_dim,
        "qk_pos_emb_head_dim": mla.qk_pos_emb_head_dim, "v_head_dim": mla.v_head_dim,
        "rope_type": None if mla.rope_type == "yarn" else mla.rope_type,
        # megatron-core's fused MLA RoPE is yarn-only: plain RoPE needs --no-rope-fusion
        "apply_rope_fusion": False if mla.rope_type == "rope" else None,
        "rotary_scaling_factor": None if mla.rotary_scaling_factor == 1.0
        else mla.rotary_scaling_factor,
        "mscale": None if mla.mscale == 1.0 else mla.mscale,
        "mscale_all_dim": None if mla.mscale_all_dim == 0.0 else mla.mscale_all_dim,
    }


def mla_mismatch(given: MLASpec | None, want: MLASpec | None) -> str | None:
    """The first flag whose value differs between two models' MLA, or None when they agree."""
    if given == want:
        return None
    if (given is None) != (want is None):
        return "--multi-latent-attention"
    assert given is not None and want is not None
    return next(flag for field, flag in _SPEC_FLAG.items()
                if getattr(given, field) != getattr(want, field))
