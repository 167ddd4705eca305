"""HuggingFace `config.json` -> ModelSpec: every field mapped, ignored with the reason, or
refused, never dropped (the tables are in fields.py, the defaults of absent fields in
defaults.py, transformers 5's spellings in formats.py, mixture of experts in moe.py)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from megatron_ext.errors import PlanError
from megatron_ext.hf_config.defaults import REQUIRED, fill_defaults
from megatron_ext.hf_config.fields import (
    FAMILIES,
    FAMILY_ALIASES,
    IGNORED,
    MLA_DETAIL,
    MLA_FIELDS,
    MOE_DETAIL,
    MOE_FAMILIES,
    MOE_FIELDS,
    REFUSED_FAMILIES,
    SOFTCAP_FIELDS,
    check_types,
    check_unknown,
)
from megatron_ext.hf_config.formats import ROPE_FIELD, rope_refusal, to_4x
from megatron_ext.hf_config.mla import MLA_FAMILIES, mla_fields, mla_notes
from megatron_ext.hf_config.moe import moe_fields, moe_notes
from megatron_ext.specs import ModelSpec

# Megatron-LM's llama3 RoPE scaling (megatron/core/models/common/embeddings/
# rotary_pos_embedding.py `_apply_scaling`) fixes these three; only the factor is a flag.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


@dataclass(frozen=True, kw_only=True, slots=True)
class HFModel:
    spec: ModelSpec
    """The model the config describes."""
    notes: tuple[str, ...] = ()
    """One line per field read but not part of the model shape: "field: reason"."""
    defaulted: tuple[str, ...] = ()
    """The fields absent from the file that took the config class's default: "field=value"."""
    defaults_from: str = ""
    """That config class (transformers' LlamaConfig, ...)."""

    def defaults_line(self, label: str) -> str | None:
        """The one-line note that names the defaulted fields, or None when there are none."""
        if not self.defaulted:
            return None
        return (f"{label}: config.json has no {', '.join(d.split('=')[0] for d in self.defaulted)}"
                f"; took the defaults of {self.defaults_from}: {', '.join(self.defaulted)}")


def model_from_hf_config(data: dict[str, Any], label: str) -> HFModel:
    """Read a HuggingFace config.json (already parsed, 4.x or 5.x format); `label` names the file
    in messages."""
    where = f"{label}: config.json"
    alias = FAMILY_ALIASES.get(str(data.get("model_type")))
    if alias is not None:
        data = {**data, "model_type": alias[0]}
    family = data.get("model_type")
    _check_family(family, where)
    check_types(data, where)
    filled, defaulted, source = fill_defaults(to_4x(data, where), family)
    _refuse_unsupported(filled, where)
    check_unknown(data, family, where)
    spec = _spec(filled, FAMILIES.get(family or "", {}), where, label)
    notes = [f"{k}: {IGNORED[k]}" for k in data if k in IGNORED]
    if alias is not None:
        notes.append(f"model_type: read as {alias[0]!r}: {alias[1]}")
    if spec.moe is not None:
        notes += moe_notes(filled)
    if spec.mla is not None:
        notes += mla_notes(filled)
    if data.get("sliding_window") is not None:
        notes.append(f"sliding_window: {data['sliding_window']} is off here (use_sliding_window "
                     "false, or the window covers every position): full causal attention")
    return HFModel(spec=spec, notes=tuple(notes), defaulted=defaulted, defaults_from=source)


def _check_family(family: Any, where: str) -> None:
    if family in REFUSED_FAMILIES:
        raise PlanError(f"{where} model_type {family!r}: {REFUSED_FAMILIES[family]}; "
                        "megatron_ext plans only what Megatron-LM's GPT model can express")
    if family is not None and family not in FAMILIES:
        close = difflib.get_close_matches(str(family), sorted(FAMILIES), n=1, cutoff=0.7)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PlanError(f"{where} model_type {family!r} is not a family megatron_ext reads; "
                        f"{hint}known: {', '.join(sorted(FAMILIES))}; describe the model with "
                        "Megatron-LM flags (a --model-config file of flags) instead")


def _refuse_unsupported(data: dict[str, Any], where: str) -> None:
    family = data.get("model_type")
    for key in MLA_FIELDS:
        if data.get(key) is not None and family not in MLA_FAMILIES:
            raise PlanError(f"{where} {key}={data[key]}: multi-latent attention in a model_type "
                            f"({family!r}) megatron_ext does not read as MLA; known: "
                            f"{', '.join(MLA_FAMILIES)}")
    experts = next((k for k in MOE_FIELDS if _truthy(data.get(k))), None)
    if experts is not None and family not in MOE_FAMILIES:
        raise PlanError(f"{where} {experts}={data[experts]}: experts in a model_type "
                        f"({family!r}) megatron_ext does not read as mixture of experts; "
                        f"known: {', '.join(sorted(MOE_FAMILIES))}")
    detail = sorted(k for k in data if k in MOE_DETAIL | MLA_DETAIL and data[k] is not None
                    and k not in ("norm_topk_prob", "rope_interleave", "router_aux_loss_coef",
                                  "router_jitter_noise", "num_nextn_predict_layers"))
    if detail and family not in MOE_FAMILIES:
        raise PlanError(f"{where} {detail[0]}={data[detail[0]]}: a mixture-of-experts / MLA "
                        "field in a config without experts; megatron_ext cannot tell what "
                        "model this is")
    window = data.get("sliding_window")
    longest = data.get("max_position_embeddings", data.get("n_positions"))
    covers_all = isinstance(window, int) and isinstance(longest, int) and window >= longest
    if window is not None and data.get("use_sliding_window", True) and not covers_all:
        raise PlanError(f"{where} sliding_window={window}: sliding-window attention is not "
                        "supported by megatron_ext (Megatron-LM's --window-size is refused)")
    for key in SOFTCAP_FIELDS:
        if data.get(key) is not None:
            raise PlanError(f"{where} {key}={data[key]}: logit softcapping is not something "
                            "Megatron-LM's GPT model can express")
    for key in ("sliding_window_pattern", "rope_local_base_freq", "query_pre_attn_scalar"):
        if data.get(key) is not None:
            raise PlanError(f"{where} {key}={data[key]}: per-layer attention variants are not "
                            "something Megatron-LM's GPT model can express")
    scaling = data.get("rope_scaling")
    if scaling is not None and family in MLA_FAMILIES:
        if not isinstance(scaling, dict):
            raise PlanError(f"{where} rope_scaling={scaling!r} must be an object or null")
    elif isinstance(scaling, dict):  # MLA's yarn: hf_config/mla.py
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("default", "llama3"):
            raise rope_refusal(where, data.get(ROPE_FIELD, "rope_scaling"), kind)
    elif scaling is not None:
        raise PlanError(f"{where} rope_scaling={scaling!r} must be an object or null")
    if data.get("lm_head_bias"):
        raise PlanError(f"{where} lm_head_bias=true: Megatron-LM's output layer has no bias")
    if data.get("mlp_type", "default") != "default":
        raise PlanError(f"{where} mlp_type={data['mlp_type']!r}: only the default MLP is "
                        "supported")


def _required(data: dict[str, Any], where: str) -> None:
    """One line for the first size field without a value and without a default."""
    family = data.get("model_type")
    for name, gpt2_name, what in REQUIRED:
        if data.get(name) is None and data.get(gpt2_name) is None:
            if family == "gpt2" and name == "intermediate_size":
                continue  # GPT2Config's n_inner=None: 4 x n_embd
            field = gpt2_name if family == "gpt2" else name
            why = (f"model_type {family!r} has no HuggingFace default for it" if family
                   else "without a model_type there is no HuggingFace config class to take a "
                        "default from")
            raise PlanError(f"{where} has no {field} ({what}) and {why}; add "
                            f"\"{field}\": <{what}> to config.json")


def _spec(data: dict[str, Any], implied: dict[str, Any], where: str, label: str) -> ModelSpec:
    def first(*keys: str, default: Any = None) -> Any:
        for key in keys:
            if data.get(key) is not None:
                return data[key]
        return default

    _required(data, where)
    hidden = first("hidden_size", "n_embd")
    heads = first("num_attention_heads", "n_head")
    for keys, value in ((("hidden_size", "n_embd"), hidden),
                        (("num_attention_heads", "n_head"), heads)):
        if value < 1:
            key = keys[0] if data.get(keys[0]) is not None else keys[1]
            raise PlanError(f"{where} {key}={value} must be >= 1")
    head_dim = first("head_dim", default=hidden // heads if hidden % heads == 0 else None)
    if head_dim is None:
        raise PlanError(f"{where} hidden_size={hidden} is not a multiple of "
                        f"num_attention_heads={heads} and there is no head_dim")
    fields: dict[str, Any] = {
        "name": str(data.get("_name_or_path") or label),
        "num_layers": first("num_hidden_layers", "n_layer"),
        "hidden_size": hidden,
        # GPT2Config's n_inner=None is 4 x n_embd; every other family states its MLP width
        "ffn_hidden_size": first("intermediate_size", "n_inner", default=4 * hidden),
        "num_attention_heads": heads,
        "num_query_groups": first("num_key_value_heads", "n_head_kv", default=heads),
        "vocab_size": data.get("vocab_size"),
        "kv_channels": head_dim if head_dim * heads != hidden else 0,
        # absent: the family's default (defaults.py); PretrainedConfig's (tied) without one
        "tied_embeddings": bool(data.get("tie_word_embeddings", True)),
        "max_position_embeddings": first("max_position_embeddings", "n_positions", "n_ctx",
                                         default=2048),
        "position_embedding": implied.get("position_embedding", "rope"),
    }
    fields.update(_norm(data, where))
    fields.update(_activation(data, where))
    fields.update(_biases(data, implied, where))
    if implied.get("qk_layernorm") or data.get("use_qk_norm"):
        fields["qk_layernorm"] = True
    moe = moe_fields(data, fields["num_layers"], where)
    if moe is not None:
        fields["moe"] = moe
    mla = mla_fields(data, where)
    if mla is not None:  # DeepSeek's q_a_layernorm / kv_a_layernorm: the latent norms
        # transformers' head_dim here is qk_rope_head_dim (its RoPE table), no attention width
        fields.update(mla=mla, qk_layernorm=True, kv_channels=0)
        fields.update(_rope({**data, "rope_scaling": None}, head_dim, where))
    elif fields["position_embedding"] == "rope":
        fields.update(_rope(data, head_dim, where))
    try:
        return ModelSpec.from_dict(fields, path=f"{label} (from config.json)")
    except PlanError as err:
        raise PlanError(f"{where}: {err}") from None


def _norm(data: dict[str, Any], where: str) -> dict[str, Any]:
    kind = data.get("norm_type")
    if "rms_norm_eps" in data or kind == "rms_norm":
        eps = data.get("rms_norm_eps", data.get("norm_epsilon", 1e-6))
        return {"normalization": "RMSNorm", "norm_epsilon": float(eps)}
    if kind not in (None, "layer_norm"):
        raise PlanError(f"{where} norm_type={kind!r}: use layer_norm or rms_norm")
    eps = next((data[k] for k in ("layer_norm_epsilon", "layer_norm_eps", "norm_epsilon")
                if data.get(k) is not None), 1e-5)
    return {"normalization": "LayerNorm", "norm_epsilon": float(eps)}


def _activation(data: dict[str, Any], where: str) -> dict[str, Any]:
    key = next((k for k in ("hidden_act", "hidden_activation", "activation_function")
                if data.get(k) is not None), None)
    act = data[key] if key else "silu"
    family = data.get("model_type")
    gated = family not in ("gpt2", "starcoder2")  # Llama-style MLPs have gate/up/down
    if act in ("silu", "swish") and gated:
        return {"activation": "swiglu"}
    if act == "gelu" and not gated:
        return {"activation": "gelu"}  # exact (erf) gelu, Megatron-LM's default
    what = ("a tanh-approximated gelu (Megatron-LM's --openai-gelu, which megatron_ext does not "
            "support)" if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
            else "an activation megatron_ext does not support (gelu or SwiGLU only)")
    raise PlanError(f"{where} {key}={act!r}{' in a gated MLP' if gated else ''}: {what}")


def _biases(data: dict[str, Any], implied: dict[str, Any], where: str) -> dict[str, Any]:
    if implied.get("add_bias_linear") or data.get("use_bias"):
        return {"add_bias_linear": True}
    attention, mlp = bool(data.get("attention_bias")), bool(data.get("mlp_bias"))
    if attention and mlp:
        return {"add_bias_linear": True}
    if attention or mlp:
        key, other = ("attention_bias", "mlp_bias") if attention else ("mlp_bias",
                                                                        "attention_bias")
        raise PlanError(f"{where} {key}=true without {other}: Megatron-LM biases all linear "
                        "layers (--disable-bias-linear off) or only q/k/v (--add-qkv-bias), not "
                        "this mix")
    # Qwen2's q/k/v biases are fixed; Qwen2-MoE's qkv_bias (default true) may turn them off
    return {"add_qkv_bias": bool(data.get("qkv_bias", implied.get("add_qkv_bias", False)))}


def _rope(data: dict[str, Any], head_dim: int, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    theta = data.get("rope_theta", 10000)
    if float(theta) != int(theta):
        raise PlanError(f"{where} rope_theta={theta}: Megatron-LM's --rotary-base is an integer")
    out["rotary_base"] = int(theta)
    if data.get("partial_rotary_factor") is not None:
        out["rotary_percent"] = float(data["partial_rotary_factor"])
    elif data.get("rotary_dim") is not None:
        out["rotary_percent"] = data["rotary_dim"] / head_dim
    scaling = data.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in ("default", None):  # anything but default and llama3 is refused above
            return out
        for key, fixed in _LLAMA3_FIXED.items():
            if float(scaling.get(key, fixed)) != fixed:
                raise PlanError(f"{where} rope_scaling.{key}={scaling[key]}: Megatron-LM's Llama "
                                f"3 scaling fixes it at {fixed:g}")
        out["rope_scaling"] = True
        out["rope_scaling_factor"] = float(scaling.get("factor", 8.0))
    return out


def _truthy(value: Any) -> bool:
    if isinstance(value, list):
        return any(_truthy(v) for v in value)
    return bool(value)


