"""What a field absent from a `config.json` means: the default of HuggingFace transformers'
config class for that model_type (transformers 5.x; tests/unit/test_hf_defaults.py checks this
table against the installed classes, the package itself never imports transformers).

Only the fields the reader maps are listed. None is the class's "derived" default, resolved as
the class does: num_key_value_heads = num_attention_heads, head_dim = hidden_size //
num_attention_heads, n_inner = 4 * n_embd, mlp_only_layers = [].
"""

from __future__ import annotations

from typing import Any

# (config class, {field: default}); rope_theta is the class's `default_theta` (transformers 5
# writes it inside rope_parameters).
_Table = dict[str, tuple[str, dict[str, Any]]]

_LLAMA_LIKE = {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0}
_QWEN_WINDOW = {"use_sliding_window": False, "sliding_window": 4096}
_QWEN_MOE = {"decoder_sparse_step": 1, "norm_topk_prob": False, "router_aux_loss_coef": 0.001,
             "mlp_only_layers": None}

DEFAULTS: _Table = {
    "llama": ("LlamaConfig", {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "head_dim": None, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "attention_bias": False, "mlp_bias": False, **_LLAMA_LIKE}),
    "mistral": ("MistralConfig", {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": None, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "sliding_window": 4096, **_LLAMA_LIKE}),
    "qwen2": ("Qwen2Config", {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, **_QWEN_WINDOW,
        **_LLAMA_LIKE}),
    "qwen3": ("Qwen3Config", {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "attention_bias": False, **_QWEN_WINDOW, **_LLAMA_LIKE}),
    "phi3": ("Phi3Config", {
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "sliding_window": None,
        **_LLAMA_LIKE}),
    "starcoder2": ("Starcoder2Config", {
        "vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288,
        "num_hidden_layers": 30, "num_attention_heads": 24, "num_key_value_heads": 2,
        "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 4096,
        "norm_epsilon": 1e-5, "sliding_window": None, "use_bias": True,
        "tie_word_embeddings": True, "rope_theta": 10000.0}),
    "gpt2": ("GPT2Config", {
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": None, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
        **{**_LLAMA_LIKE, "rope_theta": 1000000.0}}),
    "qwen2_moe": ("Qwen2MoeConfig", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "num_experts": 60,
        "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "qkv_bias": True, **_QWEN_MOE,
        **_QWEN_WINDOW, **_LLAMA_LIKE}),
    "qwen3_moe": ("Qwen3MoeConfig", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "attention_bias": False,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        **_QWEN_MOE, **_QWEN_WINDOW, **_LLAMA_LIKE}),
    # not in transformers: DeepSeek-MoE's own configuration_deepseek.py (remote code); its MoE
    # fields only, the rest of a DeepSeek-MoE config must be in the file
    "deepseek": ("DeepseekConfig", {
        "moe_intermediate_size": 1407, "moe_layer_freq": 1, "first_k_dense_replace": 0,
        "norm_topk_prob": False, "scoring_func": "softmax", "aux_loss_alpha": 0.001,
        "seq_aux": True}),
    # multi-latent attention + DeepSeek-MoE; q_lora_rank null (DeepSeek-V2-Lite) is no query
    # compression, absent the class's 1536
    "deepseek_v2": ("DeepseekV2Config", {
        "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "head_dim": None, "first_k_dense_replace": 0, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "n_group": None, "n_routed_experts": 64, "n_shared_experts": 2, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "topk_group": None,
        "topk_method": "greedy", "norm_topk_prob": False, "v_head_dim": 128,
        "num_experts_per_tok": None, "moe_intermediate_size": 1407, "rope_theta": 10000.0}),
    "deepseek_v3": ("DeepseekV3Config", {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
        "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_interleave": True,
        "attention_bias": False, "rope_theta": 10000.0}),
}
# The routing fields transformers' DeepSeek-V2/V3 classes drop (their modeling code fixes them),
# with the defaults of DeepSeek's own configuration_deepseek.py (remote code) of each model.
DEEPSEEK_ROUTING: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"moe_layer_freq": 1, "scoring_func": "softmax", "aux_loss_alpha": 0.001,
                    "seq_aux": True},
    "deepseek_v3": {"moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                    "aux_loss_alpha": 0.001, "seq_aux": True},
}
# Read without a default anywhere: a config must say them (GPT-2 names in brackets).
REQUIRED = (("num_hidden_layers", "n_layer", "the number of decoder layers"),
            ("hidden_size", "n_embd", "the model width"),
            ("num_attention_heads", "n_head", "the number of attention heads"),
            ("intermediate_size", "n_inner", "the MLP width"),
            ("vocab_size", "vocab_size", "the vocabulary size"))


def fill_defaults(data: dict[str, Any], family: str | None
                  ) -> tuple[dict[str, Any], tuple[str, ...], str]:
    """`data` with the absent fields set to the family's class defaults; which were absent
    ("field=value", the derived ones left out), and the class they came from."""
    source, table = DEFAULTS.get(family or "", ("", {}))
    table = {**table, **DEEPSEEK_ROUTING.get(family or "", {})}
    absent = [k for k in table if k not in data]
    filled = {**data, **{k: table[k] for k in absent}}
    # the derived ones (None) mean what the 4.x files always meant by leaving them out
    named = tuple(f"{k}={table[k]!r}" for k in absent if table[k] is not None)
    where = "DeepSeek-MoE's configuration_deepseek.py" if family == "deepseek" else (
        f"transformers' {source}")
    if family in DEEPSEEK_ROUTING:
        where += " (routing: DeepSeek's configuration_deepseek.py)"
    return filled, named, where
