"""HuggingFace config.json reading, field by field: transformers 5's spellings (rope_parameters,
dtype, layer_types), absent fields (the config class's default, named on stderr, or one line
naming the HuggingFace field), wrong JSON types, misspelt fields and model names. Configs as
transformers itself writes them are in test_hf_transformers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.hf_config import model_from_hf_config
from megatron_ext.presets import cluster_preset, model_file_with_notes, model_preset

LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
         "vocab_size": 1000, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
         "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
         "hidden_act": "silu", "head_dim": 64}
V5_ROPE = {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}


def _refused(data: dict, match: str) -> str:
    with pytest.raises(PlanError) as err:
        model_from_hf_config(data, "x")
    message = str(err.value)
    assert message.startswith("x: config.json ") and "\n" not in message, message
    assert match in message, message
    return message


def test_rope_parameters_read_like_rope_theta_and_rope_scaling() -> None:
    v4 = model_from_hf_config({**LLAMA, "rope_theta": 500000.0}, "x")
    v5 = model_from_hf_config({**LLAMA, **V5_ROPE}, "x")
    assert v4 == v5 and v5.spec.rotary_base == 500000 and not v5.defaulted
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    scaled = model_from_hf_config(
        {**LLAMA, "rope_parameters": {"rope_theta": 500000.0, **llama3}}, "x").spec
    assert scaled == model_from_hf_config(
        {**LLAMA, "rope_theta": 500000.0, "rope_scaling": llama3}, "x").spec
    assert (scaled.rope_scaling, scaled.rope_scaling_factor) == (True, 32.0)
    _refused({**LLAMA, "rope_parameters": {**llama3, "high_freq_factor": 2.0}},
             "rope_scaling.high_freq_factor=2.0: Megatron-LM's Llama 3 scaling fixes it at 4")


@pytest.mark.parametrize("kind, what", [("yarn", "YaRN"), ("linear", "linear position"),
                                        ("dynamic", "dynamic NTK"), ("longrope", "LongRoPE")])
def test_rope_types_megatron_cannot_plan_are_refused_by_name(kind: str, what: str) -> None:
    params = {"rope_theta": 1e6, "rope_type": kind, "factor": 4.0}
    _refused({**LLAMA, "rope_parameters": params}, f"rope_parameters type {kind!r}: {what}")
    _refused({**LLAMA, "rope_scaling": {"rope_type": kind, "factor": 4.0}},
             f"rope_scaling type {kind!r}: {what}")


def test_rope_parameters_conflicts_and_per_layer_rope() -> None:
    _refused({**LLAMA, **V5_ROPE, "rope_theta": 10000.0},
             "rope_theta=10000.0 and rope_parameters.rope_theta=500000.0 disagree")
    _refused({**LLAMA, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                                           "factor": 2.0}},
             "rope_parameters.factor=2.0 is not a field of rope_type 'default'")
    _refused({**LLAMA, "rope_parameters": {"full_attention": {"rope_theta": 1e6},
                                           "sliding_attention": {"rope_theta": 1e4}}},
             "rope_parameters has one entry per layer type ('full_attention', ...)")


def test_layer_types_all_full_attention_is_plain_attention() -> None:
    qwen = {**LLAMA, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": 2}
    plain = model_from_hf_config(qwen, "x").spec
    full = model_from_hf_config({**qwen, "layer_types": ["full_attention"] * 4}, "x").spec
    assert plain == full and full.add_qkv_bias
    mixed = ["full_attention"] * 3 + ["sliding_attention"]
    message = _refused({**qwen, "layer_types": mixed},
                       "layer_types[3]='sliding_attention' (layers 0-2 are 'full_attention')")
    assert "per-layer attention variants" in message
    _refused({**qwen, "layer_types": ["linear_attention"] * 4},
             "layer_types[0]='linear_attention': per-layer")
    _refused({**qwen, "layer_types": ["full_attention"] * 3},
             "layer_types has 3 entries for num_hidden_layers=4")


def test_dtype_and_torch_dtype_are_both_read() -> None:
    for key in ("dtype", "torch_dtype"):
        hf = model_from_hf_config({**LLAMA, key: "bfloat16"}, "x")
        assert any(n.startswith(f"{key}: the dtype the weights were saved in") for n in hf.notes)


def test_ignored_fields_are_listed_per_family() -> None:
    qwen = model_from_hf_config({**LLAMA, "model_type": "qwen2", "max_window_layers": 2}, "x")
    assert any(n.startswith("max_window_layers: ") for n in qwen.notes)
    _refused({**LLAMA, "max_window_layers": 2},
             "field 'max_window_layers' is not one megatron_ext knows how to map for "
             "model_type 'llama'")
    _refused({**LLAMA, "model_type": "gpt2", "scale_attn_by_inverse_layer_idx": True},
             "scale_attn_by_inverse_layer_idx=True: GPT-2's attention scaled by 1/(layer + 1)")


def test_absent_field_takes_the_config_class_default_and_says_so(tmp_path: Path,
                                                                  capsys) -> None:
    data = {**{k: v for k, v in LLAMA.items() if k != "intermediate_size"}, "rope_theta": 1e4}
    hf = model_from_hf_config(data, "x")
    assert hf.spec.ffn_hidden_size == 11008 and hf.defaulted == ("intermediate_size=11008",)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    model_file_with_notes(path)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no intermediate_size" in err
    assert "transformers' LlamaConfig: intermediate_size=11008" in err
    # a Mistral config without sliding_window gets MistralConfig's 4096 window, and is refused
    _refused({**data, "model_type": "mistral", "intermediate_size": 512,
              "max_position_embeddings": 32768}, "sliding_window=4096")
    # Qwen2-MoE's qkv_bias (default true) may turn the family's q/k/v biases off
    moe = {**LLAMA, "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256}
    assert model_from_hf_config(moe, "x").spec.add_qkv_bias
    assert not model_from_hf_config({**moe, "qkv_bias": False}, "x").spec.add_qkv_bias


@pytest.mark.parametrize("field", ["num_hidden_layers", "hidden_size", "num_attention_heads",
                                   "intermediate_size", "vocab_size"])
def test_absent_field_without_a_default_names_the_hf_field(field: str) -> None:
    data = {k: v for k, v in LLAMA.items() if k not in ("model_type", field)}
    message = _refused(data, f"has no {field} (")
    assert "without a model_type" in message and f'add "{field}": <' in message
    assert "num_layers" not in message.replace("num_hidden_layers", "")


def test_deepseek_moe_fields_without_a_default() -> None:
    data = {**LLAMA, "model_type": "deepseek"}
    data.pop("num_hidden_layers")
    _refused(data, "has no num_hidden_layers (the number of decoder layers) and model_type "
                   "'deepseek' has no HuggingFace default for it")


@pytest.mark.parametrize("field, value, match", [
    ("num_hidden_layers", "32", "num_hidden_layers='32' is a string; HuggingFace's config holds "
                                "an integer there: write 32 without the quotes"),
    ("rms_norm_eps", "1e-5", "rms_norm_eps='1e-5' is a string; HuggingFace's config holds a "
                             "number there"),
    ("tie_word_embeddings", "false", "tie_word_embeddings='false' is a string; HuggingFace's "
                                     "config holds true or false there"),
    ("hidden_size", 256.5, "hidden_size=256.5 is a decimal number; HuggingFace's config holds "
                           "an integer"),
    ("num_attention_heads", True, "num_attention_heads=True is a boolean"),
    ("layer_types", "full_attention", "layer_types='full_attention' is a string"),
])
def test_wrong_json_types_say_so(field: str, value: object, match: str) -> None:
    _refused({**LLAMA, field: value}, match)


def test_did_you_mean() -> None:
    _refused({**LLAMA, "intermediate_sise": 512},
             "field 'intermediate_sise' is not one megatron_ext knows how to map for model_type "
             "'llama'; did you mean 'intermediate_size'?")
    _refused({**LLAMA, "model_type": "lama"}, "model_type 'lama' is not a family megatron_ext "
                                              "reads; did you mean 'llama'?")
    for name, close in (("llama2_7b", "llama2-7b"), ("Llama3-8B", "llama3-8b")):
        with pytest.raises(PlanError, match=f"did you mean '{close}'"):
            model_preset(name)
    with pytest.raises(PlanError, match="did you mean 'dgx-h100'"):
        cluster_preset("dgx_h100")
    with pytest.raises(PlanError) as err:
        model_preset("bert-base")
    assert "did you mean" not in str(err.value)


def test_wrong_json_types_inside_rope_parameters() -> None:
    _refused({**LLAMA, "rope_parameters": {"rope_theta": "1e6", "rope_type": "default"}},
             "rope_parameters.rope_theta='1e6' is a string; HuggingFace's config holds a number "
             "there: write 1e6 without the quotes")
    _refused({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": [8]}},
             "rope_scaling.factor=[8] is a list; HuggingFace's config holds a number there")
