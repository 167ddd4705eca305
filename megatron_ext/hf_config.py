"""HuggingFace `config.json` -> ModelSpec: every field mapped, noted or refused, never dropped.

A field is
- mapped onto a ModelSpec field with Megatron-LM's meaning (rope_theta -> rotary_base, i.e.
  --rotary-base; a Llama 3 `rope_scaling` -> --use-rope-scaling; qkv biases -> --add-qkv-bias;
  Qwen3's q/k norms -> --qk-layernorm; ...),
- noted: it does not shape the model (token ids, dtype, dropout, generation switches); the
  note says why, and `megatron-ext search --model-config` prints it,
- or refused in one line naming the field, its value and what Megatron-LM cannot express
  (multi-latent attention, sliding windows, logit softcapping, GeGLU, ...).

Mixture-of-experts configs (Mixtral, Qwen1.5/Qwen2-MoE, Qwen3-MoE, DeepSeek-MoE) become the
ModelSpec's `moe` (MoESpec, Megatron-LM's --num-experts family): expert count and width, top-k,
shared experts (Qwen's gated one: --moe-shared-expert-gate; DeepSeek's n of them: one MLP n times
as wide), which layers are MoE (Qwen's decoder_sparse_step/mlp_only_layers and DeepSeek's
first_k_dense_replace/moe_layer_freq -> --moe-layer-freq), routing (norm_topk_prob=false is
Megatron's --moe-router-pre-softmax: softmax over all experts, top-k, no renormalisation) and
the load-balancing loss. DeepSeek-V2/V3 use multi-latent attention and are refused for it.

Fields absent from the file take HuggingFace's defaults (`tie_word_embeddings` is true unless the
file says false). A field this module does not know is refused too: a silently ignored field is
how a different model gets planned. `model_type` picks the family's implied structure (Qwen2's
q/k/v biases, Qwen3's q/k norms, ...), and families Megatron-LM's GPT layer cannot express (GPT-J
and phi-2 parallel blocks, OLMo 2's norm placement, Gemma) are refused by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_ext.errors import PlanError
from megatron_ext.specs import ModelSpec


@dataclass(frozen=True)
class HFModel:
    spec: ModelSpec
    notes: tuple[str, ...]
    """One line per field read but not part of the model shape, with the reason."""


# Families whose layer is Megatron-LM's GPT layer (pre-norm, attention then MLP). Value: the
# structure the family implies beyond the keys, and its class's tie_word_embeddings default
# (transformers' LlamaConfig, MistralConfig, Qwen2Config, ... default to untied; GPT2Config and
# Starcoder2Config keep PretrainedConfig's tied default).
_UNTIED = {"tied": False}
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": _UNTIED, "mistral": _UNTIED, "qwen2": {"add_qkv_bias": True, "tied": False},
    "qwen3": {"qk_layernorm": True, "tied": False}, "phi3": _UNTIED, "starcoder2": {},
    "gpt2": {"add_bias_linear": True, "position_embedding": "learned_absolute"},
    # MoE families: read so that the refusal names the MoE field, not the model_type
    "mixtral": _UNTIED, "qwen2_moe": {"add_qkv_bias": True, "tied": False},
    "qwen3_moe": {"qk_layernorm": True, "tied": False}, "deepseek": _UNTIED,
    "deepseek_v2": _UNTIED, "deepseek_v3": _UNTIED,
}
_REFUSED_FAMILIES = {
    "gptj": "GPT-J computes attention and MLP in parallel from one norm (a parallel block); "
            "Megatron-LM's GPT layer runs them one after the other",
    "phi-msft": "phi-2 computes attention and MLP in parallel from one norm (a parallel block); "
                "Megatron-LM's GPT layer runs them one after the other",
    "phi": "phi-1/phi-2 compute attention and MLP in parallel from one norm (a parallel block); "
           "Megatron-LM's GPT layer runs them one after the other",
    "olmo2": "OLMo 2 normalises after attention and MLP (and q/k over all heads); Megatron-LM's "
             "GPT layer normalises before them",
    "gemma": "Gemma's gated GeGLU MLP (tanh gelu with a gate; Megatron-LM has --swiglu and "
             "--quick-geglu only), its sqrt(hidden) embedding scale and (1 + w) norms",
    "gemma2": "Gemma 2's gated GeGLU MLP (tanh gelu with a gate; Megatron-LM has --swiglu and "
              "--quick-geglu only), its sqrt(hidden) embedding scale, (1 + w) norms and the "
              "extra norms after attention and MLP",
    "gemma3_text": "Gemma 3's gated GeGLU MLP (tanh gelu with a gate; Megatron-LM has --swiglu "
                   "and --quick-geglu only), its sqrt(hidden) embedding scale, (1 + w) norms "
                   "and the extra norms after attention and MLP",
}

# Fields that do not shape the model: (reason). Read, noted, not mapped.
_NOTED = {
    "architectures": "names the HuggingFace class; model_type picks the family",
    "model_type": "picks the family",
    "_name_or_path": "the model's name",
    "torch_dtype": "the dtype the weights were saved in; pick --bf16/--fp16 for training",
    "transformers_version": "metadata",
    "use_cache": "an inference switch (KV cache)",
    "bos_token_id": "a tokenizer id", "eos_token_id": "a tokenizer id",
    "pad_token_id": "a tokenizer id", "tokenizer_class": "names the tokenizer",
    "initializer_range": "the init std of the original run; pass --init-method-std to "
                         "pretrain_gpt.py",
    "attention_dropout": "a training hyper-parameter; pass --attention-dropout to pretrain_gpt.py",
    "hidden_dropout": "a training hyper-parameter; pass --hidden-dropout to pretrain_gpt.py",
    "resid_pdrop": "a training hyper-parameter; pass --hidden-dropout to pretrain_gpt.py",
    "embd_pdrop": "a training hyper-parameter; pass --hidden-dropout to pretrain_gpt.py",
    "attn_pdrop": "a training hyper-parameter; pass --attention-dropout to pretrain_gpt.py",
    "residual_dropout": "a training hyper-parameter; pass --hidden-dropout to pretrain_gpt.py",
    "embedding_dropout": "a training hyper-parameter; pass --hidden-dropout to pretrain_gpt.py",
    "summary_activation": "GPT-2's sequence-classification head, not the language model",
    "summary_first_dropout": "GPT-2's sequence-classification head, not the language model",
    "summary_proj_to_labels": "GPT-2's sequence-classification head, not the language model",
    "summary_type": "GPT-2's sequence-classification head, not the language model",
    "summary_use_proj": "GPT-2's sequence-classification head, not the language model",
    "task_specific_params": "generation settings",
    "pretraining_tp": "how the original run split its matmuls; the maths is the same",
    "scale_attn_weights": "1/sqrt(head_dim) attention scaling, as Megatron-LM does",
    "attention_softmax_in_fp32": "softmax precision; pass --attention-softmax-in-fp32",
    "scale_attention_softmax_in_fp32": "softmax precision; pass --attention-softmax-in-fp32",
    "cache_implementation": "an inference switch (KV cache)",
    "output_router_logits": "turns HuggingFace's load-balancing loss on in training; Megatron "
                            "adds --moe-aux-loss-coeff's loss per MoE layer whenever the "
                            "coefficient is nonzero",
    "ep_size": "an inference hint of DeepSeek's code (expert-parallel ranks); the plan sets ep",
    "original_max_position_embeddings": "the context the model was first trained on",
    "auto_map": "remote-code class names",
    "rope_traditional": "an MLX export switch",
    "max_window_layers": "layers that would use sliding windows; use_sliding_window is off",
}

_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank")
_SOFTCAP_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping")
_MOE_DETAIL = {  # meaningful only with experts (read by _moe); refused without them
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "decoder_sparse_step", "norm_topk_prob", "n_shared_experts", "first_k_dense_replace",
    "moe_layer_freq", "routed_scaling_factor", "scoring_func", "topk_method", "n_group",
    "topk_group", "mlp_only_layers", "aux_loss_alpha", "seq_aux", "router_aux_loss_coef",
    "router_jitter_noise", "num_nextn_predict_layers",
}
_MLA_DETAIL = {"qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave"}
_MOE_FAMILIES = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek"}
# transformers' (and DeepSeek-MoE's own configuration_deepseek.py) defaults for absent keys
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
                  "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": []},
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "decoder_sparse_step": 1, "norm_topk_prob": False,
                  "router_aux_loss_coef": 0.001, "mlp_only_layers": []},
    "deepseek": {"n_routed_experts": None, "num_experts_per_tok": None,
                 "moe_intermediate_size": 1407, "n_shared_experts": None, "moe_layer_freq": 1,
                 "first_k_dense_replace": 0, "norm_topk_prob": False, "scoring_func": "softmax",
                 "aux_loss_alpha": 0.001, "seq_aux": True},
}
_MAPPED = {
    "num_hidden_layers", "n_layer", "hidden_size", "n_embd", "intermediate_size", "n_inner",
    "num_attention_heads", "n_head", "num_key_value_heads", "n_head_kv", "vocab_size",
    "head_dim", "max_position_embeddings", "n_positions", "n_ctx", "tie_word_embeddings",
    "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon", "norm_type",
    "hidden_act", "hidden_activation", "activation_function", "rope_theta",
    "partial_rotary_factor", "rotary_dim", "rope_scaling", "attention_bias", "mlp_bias",
    "use_bias", "mlp_type", "sliding_window", "use_sliding_window",
    "sliding_window_pattern", "layer_types", "rope_local_base_freq", "query_pre_attn_scalar",
    "qkv_bias", "use_qk_norm", "lm_head_bias", *_MOE_FIELDS, *_MLA_FIELDS, *_SOFTCAP_FIELDS,
    *_MOE_DETAIL, *_MLA_DETAIL,
}
# Megatron-LM's llama3 RoPE scaling (megatron/core/models/common/embeddings/
# rotary_pos_embedding.py `_apply_scaling`) fixes these three; only the factor is a flag.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


def model_from_hf_config(data: dict[str, Any], label: str) -> HFModel:
    """Read a HuggingFace config.json (already parsed); `label` names the file in messages."""
    where = f"{label}: config.json"
    family = data.get("model_type")
    if family in _REFUSED_FAMILIES:
        raise PlanError(f"{where} model_type {family!r}: {_REFUSED_FAMILIES[family]}; "
                        "megatron_ext plans only what Megatron-LM's GPT model can express")
    if family is not None and family not in _FAMILIES:
        raise PlanError(f"{where} model_type {family!r} is not a family megatron_ext reads; "
                        f"known: {', '.join(sorted(_FAMILIES))}; describe the model with "
                        "Megatron-LM flags (a --model-config file of flags) instead")
    _refuse_unsupported(data, where)
    unknown = sorted(k for k in data if k not in _MAPPED and k not in _NOTED)
    if unknown:
        raise PlanError(f"{where} field {unknown[0]!r} is not one megatron_ext knows how to "
                        "map; check the model needs nothing Megatron-LM cannot express and "
                        "describe it with Megatron-LM flags instead")
    implied = dict(_FAMILIES.get(family, {}))
    spec = _spec(data, implied, where, label)
    notes = [f"{k}: {_NOTED[k]}" for k in data if k in _NOTED]
    if spec.moe is not None:
        notes += _moe_notes(data, family)
    if data.get("sliding_window") is not None:
        notes.append(f"sliding_window: {data['sliding_window']} is off here (use_sliding_window "
                     "false, or the window covers every position): full causal attention")
    return HFModel(spec, tuple(notes))


def _refuse_unsupported(data: dict[str, Any], where: str) -> None:
    for key in _MLA_FIELDS:
        if data.get(key) is not None:
            raise PlanError(f"{where} {key}={data[key]}: multi-latent attention (MLA) is not "
                            "supported by megatron_ext")
    family = data.get("model_type")
    if family in ("deepseek_v2", "deepseek_v3"):
        raise PlanError(f"{where} model_type {family!r}: multi-latent attention (MLA: "
                        "kv_lora_rank, q_lora_rank) is not supported by megatron_ext")
    experts = next((k for k in _MOE_FIELDS if _truthy(data.get(k))), None)
    if experts is not None and family not in _MOE_FAMILIES:
        raise PlanError(f"{where} {experts}={data[experts]}: experts in a model_type "
                        f"({family!r}) megatron_ext does not read as mixture of experts; "
                        f"known: {', '.join(sorted(_MOE_FAMILIES))}")
    detail = sorted(k for k in data if k in _MOE_DETAIL | _MLA_DETAIL and data[k] is not None
                    and k not in ("norm_topk_prob", "rope_interleave", "router_aux_loss_coef",
                                  "router_jitter_noise", "num_nextn_predict_layers"))
    if detail and family not in _MOE_FAMILIES:
        raise PlanError(f"{where} {detail[0]}={data[detail[0]]}: a mixture-of-experts / MLA "
                        "field in a config without experts; megatron_ext cannot tell what "
                        "model this is")
    window = data.get("sliding_window")
    longest = data.get("max_position_embeddings", data.get("n_positions"))
    covers_all = isinstance(window, int) and isinstance(longest, int) and window >= longest
    if window is not None and data.get("use_sliding_window", True) and not covers_all:
        raise PlanError(f"{where} sliding_window={window}: sliding-window attention is not "
                        "supported by megatron_ext (Megatron-LM's --window-size is refused)")
    for key in _SOFTCAP_FIELDS:
        if data.get(key) is not None:
            raise PlanError(f"{where} {key}={data[key]}: logit softcapping is not something "
                            "Megatron-LM's GPT model can express")
    for key in ("sliding_window_pattern", "layer_types", "rope_local_base_freq",
                "query_pre_attn_scalar"):
        if data.get(key) is not None:
            raise PlanError(f"{where} {key}={data[key]}: per-layer attention variants are not "
                            "something Megatron-LM's GPT model can express")
    scaling = data.get("rope_scaling")
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("default", "llama3"):
            raise PlanError(f"{where} rope_scaling type {kind!r}: only Llama 3's scaling "
                            "(--use-rope-scaling) is something Megatron-LM can express")
    elif scaling is not None:
        raise PlanError(f"{where} rope_scaling={scaling!r} must be an object or null")
    if data.get("lm_head_bias"):
        raise PlanError(f"{where} lm_head_bias=true: Megatron-LM's output layer has no bias")
    if data.get("mlp_type", "default") != "default":
        raise PlanError(f"{where} mlp_type={data['mlp_type']!r}: only the default MLP is "
                        "supported")


def _spec(data: dict[str, Any], implied: dict[str, Any], where: str, label: str) -> ModelSpec:
    def first(*keys: str, default: Any = None) -> Any:
        for key in keys:
            if data.get(key) is not None:
                return data[key]
        return default

    hidden = first("hidden_size", "n_embd")
    heads = first("num_attention_heads", "n_head")
    if not isinstance(hidden, int) or not isinstance(heads, int):
        raise PlanError(f"{where} needs hidden_size and num_attention_heads")
    head_dim = first("head_dim", default=hidden // heads if hidden % heads == 0 else None)
    if head_dim is None:
        raise PlanError(f"{where} hidden_size={hidden} is not a multiple of "
                        f"num_attention_heads={heads} and there is no head_dim")
    fields: dict[str, Any] = {
        "name": str(data.get("_name_or_path") or label),
        "num_layers": first("num_hidden_layers", "n_layer"),
        "hidden_size": hidden,
        "ffn_hidden_size": first("intermediate_size", "n_inner", default=4 * hidden),
        "num_attention_heads": heads,
        "num_query_groups": first("num_key_value_heads", "n_head_kv", default=heads),
        "vocab_size": data.get("vocab_size"),
        "kv_channels": head_dim if head_dim * heads != hidden else 0,
        # absent: the family's default; PretrainedConfig's (tied) without a model_type
        "tied_embeddings": bool(data.get("tie_word_embeddings", implied.get("tied", True))),
        "max_position_embeddings": first("max_position_embeddings", "n_positions", "n_ctx",
                                         default=2048),
        "position_embedding": implied.get("position_embedding", "rope"),
    }
    fields.update(_norm(data, where))
    fields.update(_activation(data, where))
    fields.update(_biases(data, implied, where))
    if implied.get("qk_layernorm") or data.get("use_qk_norm"):
        fields["qk_layernorm"] = True
    moe = _moe(data, fields["num_layers"], where)
    if moe is not None:
        fields["moe"] = moe
    if fields["position_embedding"] == "rope":
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
    return {"add_qkv_bias": bool(implied.get("add_qkv_bias") or data.get("qkv_bias"))}


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
        if kind == "default":  # anything but default and llama3 is refused above
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


def _moe(data: dict[str, Any], num_layers: Any, where: str) -> dict[str, Any] | None:
    """The MoESpec fields (our names, as in a plan file) of an MoE family's config, or None when
    it has no experts (Qwen2-MoE's num_experts=0, a DeepSeek config without n_routed_experts)."""
    family = data.get("model_type")
    if family not in _MOE_FAMILIES:
        return None
    d = {**_MOE_DEFAULTS[family], **{k: v for k, v in data.items() if v is not None}}
    if not isinstance(num_layers, int) or num_layers < 1:
        return None  # ModelSpec reports the missing layer count
    if family == "mixtral":
        return _routing(d, where, experts="num_local_experts", ffn=0, shared=0, freq=1,
                        balancing=("aux_loss", d["router_aux_loss_coef"]), pre_softmax=False)
    if family in ("qwen2_moe", "qwen3_moe"):
        if not d["num_experts"]:
            return None
        if family == "qwen3_moe" and d.get("shared_expert_intermediate_size"):
            raise PlanError(f"{where} shared_expert_intermediate_size="
                            f"{d['shared_expert_intermediate_size']}: Qwen3-MoE has no shared "
                            "expert; this config is not one megatron_ext can read")
        step, only = d["decoder_sparse_step"], d["mlp_only_layers"]
        if not isinstance(step, int) or step < 1 or not isinstance(only, list):
            raise PlanError(f"{where} decoder_sparse_step={step!r} / mlp_only_layers={only!r}: "
                            "need an int >= 1 and a list of layer indices")
        # modeling_qwen2_moe.py: layer i is sparse iff i not in mlp_only_layers and
        # (i + 1) % decoder_sparse_step == 0; Megatron's int form is i % f == 0, so a list
        pattern = [int(i not in only and (i + 1) % step == 0) for i in range(num_layers)]
        shared = d.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
        return _routing(d, where, experts="num_experts", ffn=d["moe_intermediate_size"],
                        shared=shared, freq=1 if all(pattern) else pattern,
                        balancing=("aux_loss", d["router_aux_loss_coef"]),
                        pre_softmax=_pre_softmax(d, where), gate=bool(shared))
    # DeepSeek-MoE (configuration_deepseek.py / modeling_deepseek.py)
    if not d["n_routed_experts"]:
        return None
    if d.get("num_nextn_predict_layers"):
        raise PlanError(f"{where} num_nextn_predict_layers={d['num_nextn_predict_layers']}: "
                        "multi-token prediction (MTP) is not supported by megatron_ext")
    first, every = d["first_k_dense_replace"], d["moe_layer_freq"]
    if not isinstance(first, int) or not isinstance(every, int) or every < 1 or first < 0:
        raise PlanError(f"{where} first_k_dense_replace={first!r} / moe_layer_freq={every!r}: "
                        "need ints (>= 0, >= 1)")
    pattern = [int(i >= first and i % every == 0) for i in range(num_layers)]
    shared = (d["n_shared_experts"] or 0) * d["moe_intermediate_size"]
    spec = _routing(d, where, experts="n_routed_experts", ffn=d["moe_intermediate_size"],
                    shared=shared, freq=1 if all(pattern) else pattern,
                    balancing=("seq_aux_loss" if d["seq_aux"] else "aux_loss",
                               d["aux_loss_alpha"]),
                    pre_softmax=_pre_softmax(d, where))
    spec.update(_deepseek_routing(d, spec, where))
    return spec


def _routing(d: dict[str, Any], where: str, *, experts: str, ffn: int, shared: int,
             freq: int | list[int], balancing: tuple[str, Any], pre_softmax: bool,
             gate: bool = False) -> dict[str, Any]:
    topk = d["num_experts_per_tok"]
    if not isinstance(topk, int) or topk < 1:
        raise PlanError(f"{where} num_experts_per_tok={topk!r}: an MoE config needs the experts "
                        "per token (>= 1)")
    return {
        "num_experts": d[experts], "router_topk": topk, "ffn_hidden_size": ffn,
        "shared_expert_intermediate_size": shared, "shared_expert_gate": gate,
        "layer_freq": freq, "router_load_balancing_type": balancing[0],
        "aux_loss_coeff": float(balancing[1]), "router_pre_softmax": pre_softmax,
    }


def _pre_softmax(d: dict[str, Any], where: str) -> bool:
    """norm_topk_prob with softmax routing: true renormalises the top-k of the softmax, which is
    Megatron's default (softmax over the chosen logits); false keeps the top-k softmax weights as
    they are, Megatron's --moe-router-pre-softmax (megatron-core moe_utils.py:608)."""
    norm = d.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise PlanError(f"{where} norm_topk_prob={norm!r} must be true or false")
    return not norm


def _deepseek_routing(d: dict[str, Any], spec: dict[str, Any], where: str) -> dict[str, Any]:
    """scoring_func, topk_method with its groups, routed_scaling_factor."""
    out: dict[str, Any] = {}
    score = d["scoring_func"]
    if score not in ("softmax", "sigmoid"):
        raise PlanError(f"{where} scoring_func={score!r}: Megatron-LM routes with softmax or "
                        "sigmoid scores only")
    if score == "sigmoid":
        if spec["router_pre_softmax"] and spec["router_topk"] > 1:
            raise PlanError(f"{where} scoring_func='sigmoid' with norm_topk_prob=false: "
                            "megatron-core always renormalises sigmoid top-k weights")
        out.update(router_score_function="sigmoid", router_pre_softmax=False)
    method = d.get("topk_method", "greedy")
    groups, keep = d.get("n_group") or 1, d.get("topk_group") or 1
    if method == "noaux_tc":
        if score != "sigmoid":
            raise PlanError(f"{where} topk_method='noaux_tc' needs scoring_func='sigmoid' "
                            "(megatron-core's expert bias is sigmoid-only)")
        out.update(router_enable_expert_bias=True)
    elif method == "group_limited_greedy":
        if spec["router_topk"] != keep:
            raise PlanError(f"{where} topk_method='group_limited_greedy' with "
                            f"num_experts_per_tok={spec['router_topk']}, topk_group={keep}: "
                            "DeepSeek scores a group by its best expert, megatron-core by the "
                            "sum of its top topk/topk_group; they agree only when those are "
                            "equal")
    elif method != "greedy":
        raise PlanError(f"{where} topk_method={method!r}: use greedy, group_limited_greedy or "
                        "noaux_tc")
    if method != "greedy" and groups > 1:
        out.update(router_num_groups=groups, router_group_topk=keep)
    factor = d.get("routed_scaling_factor", 1.0)
    if factor != 1.0:
        out.update(router_topk_scaling_factor=float(factor))
    return out


def _moe_notes(data: dict[str, Any], family: str) -> list[str]:
    """What an MoE config leaves implicit or to the training run."""
    notes = []
    if data.get("router_jitter_noise"):
        notes.append(f"router_jitter_noise: {data['router_jitter_noise']} is a training-time "
                     "regularizer; pass --moe-input-jitter-eps to pretrain_gpt.py")
    absent = sorted(k for k in _MOE_DEFAULTS[family] if k not in data
                    and _MOE_DEFAULTS[family][k] is not None)
    if absent:
        notes.append("absent, the config class's defaults used: " + ", ".join(
            f"{k}={_MOE_DEFAULTS[family][k]}" for k in absent))
    if data.get("topk_method", "greedy") == "greedy" and (data.get("n_group") or 1) > 1:
        notes.append("n_group / topk_group: unused by topk_method greedy")
    return notes
