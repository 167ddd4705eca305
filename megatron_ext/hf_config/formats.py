"""transformers 5 `config.json` -> the 4.x fields the reader maps.

transformers 5.x writes RoPE as `rope_parameters` ({"rope_theta", "rope_type", the scaling's
fields, Phi-3's "partial_rotary_factor"}) instead of top-level `rope_theta` / `rope_scaling`,
`dtype` instead of `torch_dtype`, per-layer `layer_types` (["full_attention", ...]) for every
model whose class has them, and Qwen3-MoE's expert count as `num_local_experts`. Both formats are
read; a file holding both spellings of a value must give the same value.
"""

from __future__ import annotations

from typing import Any

from megatron_ext.errors import PlanError

# the keys each rope_type may carry (transformers' modeling_rope_utils, 4.x rope_scaling and
# 5.x rope_parameters alike); Megatron-LM's --use-rope-scaling is Llama 3's
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta", "partial_rotary_factor"},
    "llama3": {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor",
               "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
ROPE_FIELD = "_rope_field"
_ROPE_REFUSED = {
    "yarn": "YaRN (Megatron-LM's --position-embedding-type yarn, which megatron_ext's model "
            "description does not carry)",
    "linear": "linear position interpolation (Megatron-LM's --rotary-seq-len-interpolation-"
              "factor, which megatron_ext's model description does not carry)",
    "dynamic": "dynamic NTK scaling (no Megatron-LM flag)",
    "longrope": "LongRoPE (no Megatron-LM flag)",
    "su": "LongRoPE (no Megatron-LM flag)",
}


def rope_refusal(where: str, field: str, kind: Any) -> PlanError:
    what = _ROPE_REFUSED.get(kind, "a RoPE variant megatron_ext does not read")
    return PlanError(f"{where} {field} type {kind!r}: {what}; only plain RoPE and Llama 3's "
                     "scaling (--use-rope-scaling) are something megatron_ext can plan")


def to_4x(data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` with rope_parameters, layer_types and num_local_experts (Qwen3-MoE) turned into the
    4.x fields; refuses what has no 4.x meaning Megatron-LM can express."""
    out = dict(data)
    params = out.pop("rope_parameters", None)
    if params is not None:
        _merge_rope(out, params, where)
    _check_layer_types(out, where)
    if out.get("model_type") == "qwen3_moe" and "num_local_experts" in out:
        count = out.pop("num_local_experts")
        if out.get("num_experts", count) != count:
            raise PlanError(f"{where} num_local_experts={count} and num_experts="
                            f"{out['num_experts']} disagree; keep one")
        out["num_experts"] = count
    return out


def _merge_rope(out: dict[str, Any], params: dict[str, Any], where: str) -> None:
    nested = sorted(k for k, v in params.items() if isinstance(v, dict))
    if nested:
        raise PlanError(f"{where} rope_parameters has one entry per layer type ({nested[0]!r}, "
                        "...): per-layer RoPE is not something Megatron-LM's GPT model can "
                        "express")
    kind = params.get("rope_type", params.get("type", "default"))
    extra = sorted(set(params) - _ROPE_KEYS.get(kind, set(params)))
    if extra:
        raise PlanError(f"{where} rope_parameters.{extra[0]}={params[extra[0]]!r} is not a "
                        f"field of rope_type {kind!r}; remove it")
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in params:
            _same(out, key, params[key], where)
    scaling = {k: v for k, v in params.items()
               if k not in ("rope_theta", "partial_rotary_factor")}
    old = out.get("rope_scaling")
    old_kind = old.get("rope_type", old.get("type")) if isinstance(old, dict) else None
    if old is not None and (old_kind, kind) != ("default", "default") and old != scaling:
        raise PlanError(f"{where} rope_scaling={old!r} and rope_parameters {params!r} "
                        "disagree; keep rope_parameters")
    if kind != "default":
        out["rope_scaling"] = scaling
        out[ROPE_FIELD] = "rope_parameters"  # a refused rope_type is named as the file spells it


def _same(out: dict[str, Any], key: str, value: Any, where: str) -> None:
    if out.get(key) is not None and out[key] != value:
        raise PlanError(f"{where} {key}={out[key]!r} and rope_parameters.{key}={value!r} "
                        "disagree; keep rope_parameters")
    out[key] = value


def _check_layer_types(out: dict[str, Any], where: str) -> None:
    """All "full_attention" is plain attention (what transformers 5 writes for a Llama / Qwen2
    without sliding windows); anything else is a per-layer variant, refused at its first layer."""
    types = out.pop("layer_types", None)
    if types is None:
        return
    layers = out.get("num_hidden_layers")
    if isinstance(layers, int) and len(types) != layers:
        raise PlanError(f"{where} layer_types has {len(types)} entries for num_hidden_layers="
                        f"{layers}; give one per layer")
    for idx, kind in enumerate(types):
        if kind != "full_attention":
            before = f" (layers 0-{idx - 1} are 'full_attention')" if idx else ""
            raise PlanError(f"{where} layer_types[{idx}]={kind!r}{before}: per-layer attention "
                            "variants (sliding, linear, chunked) are not something Megatron-LM's "
                            "GPT model can express; only 'full_attention' layers are")
