"""Which HuggingFace `config.json` fields are read, per model_type: mapped onto the ModelSpec
(read.py, moe.py), read and ignored with the reason (they change nothing for training), or
refused. Field types are checked here, and a field nobody knows gets a "did you mean"."""

from __future__ import annotations

import difflib
import math
from typing import Any

from megatron_ext.errors import PlanError

# Families whose layer is Megatron-LM's GPT layer (pre-norm, attention then MLP). Value: the
# structure the family implies beyond the keys.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {}, "mistral": {}, "qwen2": {"add_qkv_bias": True},
    "qwen3": {"qk_layernorm": True}, "phi3": {}, "starcoder2": {},
    "gpt2": {"add_bias_linear": True, "position_embedding": "learned_absolute"},
    "mixtral": {}, "qwen2_moe": {"add_qkv_bias": True}, "qwen3_moe": {"qk_layernorm": True},
    "deepseek": {},
    # multi-latent attention (hf_config/mla.py) with DeepSeek-MoE experts (hf_config/moe.py)
    "deepseek_v2": {}, "deepseek_v3": {},
}
# model_types that are another family's model under a new name: (family, why).
FAMILY_ALIASES: dict[str, tuple[str, str]] = {
    "kimi_k2": ("deepseek_v3", "Kimi K2 is DeepSeek-V3's model (its config.json names "
                "DeepseekV3ForCausalLM and configuration_deepseek.DeepseekV3Config) with other "
                "sizes"),
}
_PARALLEL = ("compute attention and MLP in parallel from one norm (a parallel block); "
             "Megatron-LM's GPT layer runs them one after the other")
_GEGLU = ("gated GeGLU MLP (tanh gelu with a gate; Megatron-LM has --swiglu and --quick-geglu "
          "only), its sqrt(hidden) embedding scale, (1 + w) norms")
REFUSED_FAMILIES = {
    "gptj": f"GPT-J {_PARALLEL.replace('compute', 'computes', 1)}",
    "phi-msft": f"phi-2 {_PARALLEL.replace('compute', 'computes', 1)}",
    "phi": f"phi-1/phi-2 {_PARALLEL}",
    "olmo2": "OLMo 2 normalises after attention and MLP (and q/k over all heads); Megatron-LM's "
             "GPT layer normalises before them",
    "gemma": f"Gemma's {_GEGLU}",
    "gemma2": f"Gemma 2's {_GEGLU} and the extra norms after attention and MLP",
    "gemma3_text": f"Gemma 3's {_GEGLU} and the extra norms after attention and MLP",
}

MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank")
SOFTCAP_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping")
MOE_DETAIL = {  # meaningful only with experts (read by moe.py); refused without them
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "decoder_sparse_step", "norm_topk_prob", "n_shared_experts", "first_k_dense_replace",
    "moe_layer_freq", "routed_scaling_factor", "scoring_func", "topk_method", "n_group",
    "topk_group", "mlp_only_layers", "aux_loss_alpha", "seq_aux", "router_aux_loss_coef",
    "router_jitter_noise", "num_nextn_predict_layers",
}
MLA_DETAIL = {"qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
              "qk_head_dim"}
MOE_FAMILIES = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek", "deepseek_v2", "deepseek_v3"}
MAPPED = {
    "num_hidden_layers", "n_layer", "hidden_size", "n_embd", "intermediate_size", "n_inner",
    "num_attention_heads", "n_head", "num_key_value_heads", "n_head_kv", "vocab_size",
    "head_dim", "max_position_embeddings", "n_positions", "n_ctx", "tie_word_embeddings",
    "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon", "norm_type",
    "hidden_act", "hidden_activation", "activation_function", "rope_theta", "rope_parameters",
    "partial_rotary_factor", "rotary_dim", "rope_scaling", "attention_bias", "mlp_bias",
    "use_bias", "mlp_type", "sliding_window", "use_sliding_window",
    "sliding_window_pattern", "layer_types", "rope_local_base_freq", "query_pre_attn_scalar",
    "qkv_bias", "use_qk_norm", "lm_head_bias", *MOE_FIELDS, *MLA_FIELDS, *SOFTCAP_FIELDS,
    *MOE_DETAIL, *MLA_DETAIL,
}

_DROPOUT = "a training hyper-parameter; pass --{} to pretrain_gpt.py"
_GPT2_HEAD = "GPT-2's sequence-classification head, not the language model"
_PRETRAINED = "a switch of HuggingFace's PretrainedConfig (outputs, labels); not the model"
# Fields that change nothing for training: (reason). Read, noted, not mapped.
IGNORED = {
    "architectures": "names the HuggingFace class; model_type picks the family",
    "model_type": "picks the family",
    "_name_or_path": "the model's name",
    "torch_dtype": "the dtype the weights were saved in; pick --bf16/--fp16 for training",
    "dtype": "the dtype the weights were saved in; pick --bf16/--fp16 for training",
    "transformers_version": "metadata",
    "use_cache": "an inference switch (KV cache)",
    "cache_implementation": "an inference switch (KV cache)",
    "bos_token_id": "a tokenizer id", "eos_token_id": "a tokenizer id",
    "pad_token_id": "a tokenizer id", "tokenizer_class": "names the tokenizer",
    "initializer_range": "the init std of the original run; pass --init-method-std to "
                         "pretrain_gpt.py",
    "auto_map": "remote-code class names",
    "quantization_config": "how the published weights are stored (a quantized checkpoint for "
                           "inference); training precision is --bf16 / --fp8-format",
    "task_specific_params": "generation settings",
    "rope_traditional": "an MLX export switch",
    "output_hidden_states": _PRETRAINED, "output_attentions": _PRETRAINED,
    "return_dict": _PRETRAINED, "id2label": _PRETRAINED, "label2id": _PRETRAINED,
    "problem_type": _PRETRAINED,
    "chunk_size_feed_forward": "splits the MLP over the sequence to save memory at inference; "
                               "the same maths",
    "is_encoder_decoder": "false: a decoder-only model",
    "attention_dropout": _DROPOUT.format("attention-dropout"),
    "attn_pdrop": _DROPOUT.format("attention-dropout"),
    "resid_pdrop": _DROPOUT.format("hidden-dropout"),
    "embd_pdrop": _DROPOUT.format("hidden-dropout"),
    "residual_dropout": _DROPOUT.format("hidden-dropout"),
    "embedding_dropout": _DROPOUT.format("hidden-dropout"),
    "summary_activation": _GPT2_HEAD, "summary_first_dropout": _GPT2_HEAD,
    "summary_proj_to_labels": _GPT2_HEAD, "summary_type": _GPT2_HEAD,
    "summary_use_proj": _GPT2_HEAD,
    "scale_attn_weights": "1/sqrt(head_dim) attention scaling, as Megatron-LM does",
    "reorder_and_upcast_attn": "attention precision (fp32 dot products); pass "
                               "--attention-softmax-in-fp32",
    "scale_attn_by_inverse_layer_idx": "false: plain 1/sqrt(head_dim) scaling",
    "add_cross_attention": "false: no cross-attention",
    "pretraining_tp": "how the original run split its matmuls; the maths is the same",
    "attention_softmax_in_fp32": "softmax precision; pass --attention-softmax-in-fp32",
    "scale_attention_softmax_in_fp32": "softmax precision; pass --attention-softmax-in-fp32",
    "output_router_logits": "turns HuggingFace's load-balancing loss on in training; Megatron "
                            "adds --moe-aux-loss-coeff's loss per MoE layer whenever the "
                            "coefficient is nonzero",
    "ep_size": "an inference hint of DeepSeek's code (expert-parallel ranks); the plan sets ep",
    "original_max_position_embeddings": "the context the model was first trained on",
    "max_window_layers": "layers that would use sliding windows; use_sliding_window is off",
}
# Any family may carry these (HuggingFace's PretrainedConfig writes them for every model).
COMMON_IGNORED = {
    "architectures", "model_type", "_name_or_path", "torch_dtype", "dtype",
    "transformers_version", "use_cache", "cache_implementation", "bos_token_id",
    "eos_token_id", "pad_token_id", "tokenizer_class", "initializer_range", "auto_map",
    "task_specific_params", "rope_traditional", "output_hidden_states", "output_attentions",
    "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder", "attention_dropout", "quantization_config",
}
_QWEN = {"max_window_layers"}
_ROUTER = {"output_router_logits"}
FAMILY_IGNORED: dict[str, set[str]] = {
    "llama": {"pretraining_tp"}, "mistral": set(), "qwen2": _QWEN, "qwen3": _QWEN,
    "phi3": {"resid_pdrop", "embd_pdrop", "original_max_position_embeddings"},
    "starcoder2": {"residual_dropout", "embedding_dropout", "attention_softmax_in_fp32",
                   "scale_attention_softmax_in_fp32", "scale_attn_weights"},
    "gpt2": {"attn_pdrop", "resid_pdrop", "embd_pdrop", "summary_activation",
             "summary_first_dropout", "summary_proj_to_labels", "summary_type",
             "summary_use_proj", "scale_attn_weights", "reorder_and_upcast_attn",
             "scale_attn_by_inverse_layer_idx", "add_cross_attention"},
    "mixtral": _ROUTER, "qwen2_moe": _QWEN | _ROUTER, "qwen3_moe": _QWEN | _ROUTER,
    "deepseek": {"pretraining_tp", "ep_size"} | _ROUTER,
    "deepseek_v2": {"pretraining_tp"} | _ROUTER, "deepseek_v3": {"pretraining_tp"} | _ROUTER,
}
# Ignored only while false: true changes the model into one Megatron-LM's GPT layer is not.
FALSE_ONLY = {
    "is_encoder_decoder": "an encoder-decoder model; megatron_ext plans decoder-only GPT models",
    "scale_attn_by_inverse_layer_idx": "GPT-2's attention scaled by 1/(layer + 1) as well; "
                                       "Megatron-LM scales by 1/sqrt(head_dim) only",
    "add_cross_attention": "cross-attention layers; Megatron-LM's GPT layer has none",
}

_INT = {"num_hidden_layers", "n_layer", "hidden_size", "n_embd", "intermediate_size", "n_inner",
        "num_attention_heads", "n_head", "num_key_value_heads", "n_head_kv", "vocab_size",
        "head_dim", "max_position_embeddings", "n_positions", "n_ctx", "rotary_dim",
        "sliding_window", "max_window_layers", *MOE_FIELDS, "num_experts_per_tok",
        "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step",
        "n_shared_experts", "first_k_dense_replace", "moe_layer_freq", "n_group", "topk_group",
        "num_nextn_predict_layers"}
_NUMBER = {"rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon",
           "rope_theta", "partial_rotary_factor", "routed_scaling_factor", "aux_loss_alpha",
           "router_aux_loss_coef", "router_jitter_noise"}
_ROPE_NUMBER = {"rope_theta", "partial_rotary_factor", "factor", "low_freq_factor",
                "high_freq_factor", "original_max_position_embeddings"}
_BOOL = {"tie_word_embeddings", "attention_bias", "mlp_bias", "use_bias", "use_sliding_window",
         "qkv_bias", "use_qk_norm", "lm_head_bias", "norm_topk_prob", "seq_aux",
         "is_encoder_decoder", "scale_attn_by_inverse_layer_idx", "add_cross_attention"}
_STR = {"model_type", "hidden_act", "hidden_activation", "activation_function", "norm_type",
        "mlp_type", "scoring_func", "topk_method"}
_DICT = {"rope_parameters"}
_JSON_KIND = {str: "a string", bool: "a boolean", int: "an integer", float: "a decimal number",
              list: "a list", dict: "an object"}
_LIST = {"layer_types", "mlp_only_layers"}


def known_fields(family: str | None) -> set[str]:
    """The fields a config of `family` may carry (without a model_type: any family's)."""
    if family is None:
        return MAPPED | set(IGNORED)
    return MAPPED | COMMON_IGNORED | FAMILY_IGNORED.get(family, set())


def check_unknown(data: dict[str, Any], family: str | None, where: str) -> None:
    """One line for the first field nobody maps or ignores for this family, with the closest
    known name."""
    known = known_fields(family)
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
        hint = f"did you mean {close[0]!r}? " if close else ""
        scope = f" for model_type {family!r}" if family else ""
        raise PlanError(f"{where} field {key!r} is not one megatron_ext knows how to map{scope}; "
                        f"{hint}check the model needs nothing Megatron-LM cannot express and "
                        "describe it with Megatron-LM flags instead")


def check_types(data: dict[str, Any], where: str) -> None:
    """One line for a field of the wrong JSON type, or a false-only switch that is true."""
    for key, value in data.items():
        if value is not None:
            _check_type(key, value, where)
    for outer in ("rope_parameters", "rope_scaling"):  # RoPE's own fields, by their full name
        inner = data.get(outer)
        for key, value in (inner.items() if isinstance(inner, dict) else ()):
            if key in _ROPE_NUMBER and value is not None:
                _check_type(key, value, where, name=f"{outer}.{key}")
    for key, why in FALSE_ONLY.items():
        if data.get(key):
            raise PlanError(f"{where} {key}={data[key]!r}: {why}")


def _check_type(key: str, value: Any, where: str, *, name: str = "") -> None:
    name = name or key
    if key in _INT or key == "original_max_position_embeddings":
        ok, what = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif key in _NUMBER or key in _ROPE_NUMBER:
        ok, what = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif key in _BOOL:
        ok, what = isinstance(value, bool), "true or false"
    elif key in _STR:
        ok, what = isinstance(value, str), "a string"
    elif key in _DICT:
        ok, what = isinstance(value, dict), "an object"
    elif key in _LIST:
        ok, what = isinstance(value, list), "a list"
    else:
        return
    if ok:
        return
    if isinstance(value, str) and _parses(value, what):
        raise PlanError(f"{where} {name}={value!r} is a string; HuggingFace's config holds "
                        f"{what} there: write {value} without the quotes")
    raise PlanError(f"{where} {name}={value!r} is {_JSON_KIND.get(type(value), 'not JSON')}; "
                    f"HuggingFace's config holds {what} there")


def _parses(text: str, what: str) -> bool:
    """Whether `text` written without quotes is JSON of the kind the field holds."""
    if what == "true or false":
        return text in ("true", "false")
    if what == "an integer":
        return text.lstrip("-").isdigit()
    if what == "a number":
        try:
            return math.isfinite(float(text))
        except ValueError:
            return False
    return False
