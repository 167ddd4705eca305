"""HuggingFace multi-latent attention fields (DeepSeek-V2 / V3) -> ModelSpec.mla (MLASpec, the
plan's form of Megatron-LM's --multi-latent-attention flags).

kv_lora_rank, q_lora_rank (null: no query compression, as DeepSeek-V2-Lite; absent: the config
class's 1536, defaults.py),
qk_nope_head_dim -> qk_head_dim, qk_rope_head_dim -> qk_pos_emb_head_dim, v_head_dim; DeepSeek's
q_a_layernorm / kv_a_layernorm are megatron-core's q/kv latent norms (--qk-layernorm). A yarn
rope_scaling maps to MLA's yarn RoPE: factor -> --rotary-scaling-factor, mscale, mscale_all_dim;
Megatron-LM has no flag for beta_fast, beta_slow or original_max_position_embeddings, so only
MLATransformerConfig's 32, 1 and 4096 are read and any other value is refused by name. Without
rope_scaling, MLA uses plain RoPE (--rope-type rope). Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from megatron_ext.errors import PlanError

MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
_YARN_FIXED = {"beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096}
"""MLATransformerConfig's defaults (transformer_config.py:2046-2052); Megatron-LM has no flags."""


def mla_fields(data: dict[str, Any], where: str) -> dict[str, Any] | None:
    """The MLASpec fields (plan-file names) of a DeepSeek-V2/V3 config, or None for another
    family."""
    if data.get("model_type") not in MLA_FAMILIES:
        return None
    out: dict[str, Any] = {}
    for hf, ours in (("kv_lora_rank", "kv_lora_rank"), ("qk_nope_head_dim", "qk_head_dim"),
                     ("qk_rope_head_dim", "qk_pos_emb_head_dim"), ("v_head_dim", "v_head_dim")):
        value = data.get(hf)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"{where} {hf}={value!r}: multi-latent attention needs it as an "
                            "integer >= 1")
        out[ours] = value
    q_rank = data.get("q_lora_rank")
    if q_rank is not None and (not isinstance(q_rank, int) or q_rank < 1):
        raise PlanError(f"{where} q_lora_rank={q_rank!r} must be an integer >= 1 or null")
    out["q_lora_rank"] = q_rank
    qk_head = data.get("qk_head_dim")
    if qk_head is not None and qk_head != out["qk_head_dim"] + out["qk_pos_emb_head_dim"]:
        raise PlanError(f"{where} qk_head_dim={qk_head} is not qk_nope_head_dim + "
                        f"qk_rope_head_dim = {out['qk_head_dim'] + out['qk_pos_emb_head_dim']}")
    out.update(_rope(data.get("rope_scaling"), where))
    return out


def _rope(scaling: Any, where: str) -> dict[str, Any]:
    if scaling is None:
        return {"rope_type": "rope"}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("default", None):
        return {"rope_type": "rope"}
    if kind != "yarn":
        raise PlanError(f"{where} rope_scaling type {kind!r}: multi-latent attention in "
                        "Megatron-LM has rope or yarn RoPE only")
    for key, fixed in _YARN_FIXED.items():
        if float(scaling.get(key, fixed)) != fixed:
            raise PlanError(f"{where} rope_scaling.{key}={scaling[key]}: Megatron-LM has no flag "
                            f"for it and MLA always uses {fixed:g}")
    return {"rope_type": "yarn", "rotary_scaling_factor": float(scaling.get("factor", 1.0)),
            "mscale": float(scaling.get("mscale", 1.0)),
            "mscale_all_dim": float(scaling.get("mscale_all_dim", 0.0))}


def mla_notes(data: dict[str, Any]) -> list[str]:
    """What an MLA config leaves implicit."""
    notes = []
    if data.get("q_lora_rank") is None:
        notes.append("q_lora_rank: null, no query compression (one q projection, Megatron-LM "
                     "without --q-lora-rank)")
    if data.get("model_type") in MLA_FAMILIES:
        notes.append("rope_interleave: DeepSeek's RoPE pairs adjacent channels, Megatron's the "
                     "two halves; a fixed permutation of the q/k RoPE weights, the same model")
    return notes
