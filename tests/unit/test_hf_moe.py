"""HuggingFace mixture-of-experts configs -> ModelSpec.moe: every MoE field mapped (with
Megatron-LM's meaning), noted or refused in one line. The real files are in tests/data/hf_configs
(tests/unit/test_real_inputs.py checks their parameter counts against the model cards); here each
mapping rule is checked on the real file where one exercises it, on an edited copy otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.hf_config import model_from_hf_config

DATA = Path(__file__).resolve().parents[1] / "data" / "hf_configs"


def _read(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def _moe(data: dict):
    model = model_from_hf_config(data, "x").spec
    assert model.moe is not None
    return model, model.moe


def test_mixtral() -> None:
    model, moe = _moe(_read("Mixtral-8x7B-v0.1"))
    assert (moe.num_experts, moe.router_topk, moe.layer_freq) == (8, 2, 1)
    assert moe.expert_ffn_hidden_size(model) == 14336 and not moe.shared_expert_intermediate_size
    # softmax, top-2, renormalised: Megatron's default (no pre-softmax)
    assert (moe.router_score_function, moe.router_pre_softmax) == ("softmax", False)
    assert (moe.router_load_balancing_type, moe.aux_loss_coeff) == ("aux_loss", 0.02)


def test_qwen_moe_shared_gated_expert_and_pre_softmax() -> None:
    model, moe = _moe(_read("Qwen1.5-MoE-A2.7B"))
    assert model.add_qkv_bias and model.ffn_hidden_size == 5632
    assert (moe.num_experts, moe.router_topk, moe.ffn_hidden_size) == (60, 4, 1408)
    assert (moe.shared_expert_intermediate_size, moe.shared_expert_gate) == (5632, True)
    assert moe.router_pre_softmax  # norm_topk_prob=false: top-k of the softmax, as they are
    model, moe = _moe(_read("Qwen2-57B-A14B"))
    assert (moe.num_experts, moe.router_topk, moe.shared_expert_intermediate_size) == (
        64, 8, 20480)


def test_qwen3_moe() -> None:
    model, moe = _moe(_read("Qwen3-30B-A3B"))
    assert model.qk_layernorm and model.kv_channels == 128 and model.num_query_groups == 4
    assert (moe.num_experts, moe.router_topk, moe.ffn_hidden_size) == (128, 8, 768)
    assert not moe.router_pre_softmax and not moe.shared_expert_intermediate_size


def test_qwen_layer_pattern_follows_huggingface() -> None:
    """Layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    (HuggingFace's +1 offset differs from Megatron's int form, hence the list)."""
    data = {**_read("Qwen1.5-MoE-A2.7B"), "decoder_sparse_step": 2, "mlp_only_layers": [3],
            "num_hidden_layers": 6}
    model, moe = _moe(data)
    assert moe.layer_freq == (0, 1, 0, 0, 0, 1)
    assert model.moe is not None and [model.is_moe_layer(i) for i in range(6)] == [
        False, True, False, False, False, True]
    dense = model_from_hf_config({**data, "num_experts": 0}, "x").spec
    assert dense.moe is None  # Qwen2-MoE's num_experts=0 is a dense model


def test_deepseek_moe_dense_first_layer_shared_experts_seq_aux() -> None:
    data = _read("deepseek-moe-16b")
    hf = model_from_hf_config(data, "x")
    moe = hf.spec.moe
    assert moe is not None
    assert moe.layer_freq == (0,) + (1,) * 27  # first_k_dense_replace=1
    assert hf.spec.ffn_hidden_size == 10944 and moe.ffn_hidden_size == 1408
    assert moe.shared_expert_intermediate_size == 2 * 1408 and not moe.shared_expert_gate
    assert moe.router_pre_softmax and moe.router_topk == 6
    # absent aux_loss_alpha / seq_aux: DeepSeek-MoE's config defaults, named in a note
    assert (moe.router_load_balancing_type, moe.aux_loss_coeff) == ("seq_aux_loss", 0.001)
    assert {"aux_loss_alpha=0.001", "seq_aux=True"} <= set(hf.defaulted)
    assert "aux_loss_alpha=0.001" in (hf.defaults_line("x") or "")
    every_other = model_from_hf_config({**data, "moe_layer_freq": 2}, "x").spec.moe
    assert every_other is not None and every_other.layer_freq[:5] == (0, 0, 1, 0, 1)


def test_deepseek_v3_style_routing_on_a_deepseek_config() -> None:
    """sigmoid + noaux_tc + groups + routed_scaling_factor map to Megatron's sigmoid routing with
    expert bias, group-limited top-k and --moe-router-topk-scaling-factor."""
    data = {**_read("deepseek-moe-16b"), "scoring_func": "sigmoid", "norm_topk_prob": True,
            "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
            "routed_scaling_factor": 2.5}
    _, moe = _moe(data)
    assert (moe.router_score_function, moe.router_pre_softmax, moe.router_enable_expert_bias,
            moe.router_num_groups, moe.router_group_topk, moe.router_topk_scaling_factor) == (
        "sigmoid", False, True, 8, 4, 2.5)
    _, greedy = _moe({**data, "scoring_func": "softmax", "topk_method": "greedy",
                      "norm_topk_prob": False, "routed_scaling_factor": 1.0})
    assert (greedy.router_num_groups, greedy.router_topk_scaling_factor) == (0, 0.0)


@pytest.mark.parametrize(("name", "edit", "expected"), [
    ("deepseek-moe-16b", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid' with "
     "norm_topk_prob=false"),
    ("deepseek-moe-16b", {"scoring_func": "sparsemax"}, "scoring_func='sparsemax'"),
    ("deepseek-moe-16b", {"topk_method": "group_limited_greedy", "n_group": 8,
                          "topk_group": 3}, "topk_method='group_limited_greedy'"),
    ("deepseek-moe-16b", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc' needs "
     "scoring_func='sigmoid'"),
    ("deepseek-moe-16b", {"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1: "
     "multi-token prediction"),
    ("deepseek-moe-16b", {"num_experts_per_tok": None}, "num_experts_per_tok=None"),
    ("DeepSeek-V2-Lite", {"kv_lora_rank": None}, "kv_lora_rank=None: multi-latent attention "
     "needs it"),
    ("DeepSeek-V2-Lite", {"rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 16}},
     "rope_scaling.beta_fast=16: Megatron-LM has no flag for it"),
    ("DeepSeek-V2-Lite", {"qk_head_dim": 128}, "qk_head_dim=128 is not qk_nope_head_dim + "
     "qk_rope_head_dim = 192"),
    ("Llama-2-7b-hf", {"kv_lora_rank": 512}, "kv_lora_rank=512: multi-latent attention in a "
     "model_type ('llama')"),
    ("Qwen3-30B-A3B", {"shared_expert_intermediate_size": 1024},
     "shared_expert_intermediate_size=1024: Qwen3-MoE has no shared expert"),
    ("Qwen3-30B-A3B", {"router_logit_scale": 2}, "field 'router_logit_scale' is not one"),
    ("Llama-2-7b-hf", {"num_local_experts": 8}, "num_local_experts=8: experts in a model_type "
     "('llama')"),
    ("Llama-2-7b-hf", {"num_experts_per_tok": 2}, "num_experts_per_tok=2: a mixture-of-experts"),
    ("Mixtral-8x7B-v0.1", {"num_experts_per_tok": 1}, "router_topk=1 with softmax routing"),
])
def test_refusals(name: str, edit: dict, expected: str) -> None:
    data = {**_read(name), **edit}
    with pytest.raises(PlanError) as err:
        model_from_hf_config(data, "x")
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_jitter_is_noted_for_the_training_run() -> None:
    hf = model_from_hf_config({**_read("Mixtral-8x7B-v0.1"), "router_jitter_noise": 0.01}, "x")
    assert any(n.startswith("router_jitter_noise: 0.01 is a training-time regularizer; pass "
                            "--moe-input-jitter-eps") for n in hf.notes)


def test_cost_model_counts_the_experts_and_profile_refuses_them() -> None:
    """Reading Mixtral must not let the cost model plan it as the 7.24B dense model of the same
    shape; the layer profiler, which builds dense layers only, refuses in one line."""
    from megatron_ext.commands.moe_support import refuse_moe_profile
    from megatron_ext.planner.cost.compute import model_parameters

    model = model_from_hf_config(_read("Mixtral-8x7B-v0.1"), "Mixtral").spec
    assert 46.6e9 < model_parameters(model) < 46.8e9  # the model card's 46.7B
    with pytest.raises(PlanError, match="^profile model: Mixtral is a mixture-of-experts"):
        refuse_moe_profile(model)


@pytest.mark.parametrize(("name", "stated"), [
    ("Llama-2-7b-hf", "7B"), ("deepseek-moe-16b", "16B"), ("Mixtral-8x7B-v0.1", None),
    ("Qwen1.5-MoE-A2.7B", None), ("Qwen3-30B-A3B", "30B"), ("Qwen2-57B-A14B", "57B"),
])
def test_search_compares_only_a_stated_total(name: str, stated: str | None) -> None:
    """An MoE name's "8x7B" gives the expert size and "A2.7B" the activated parameters; neither
    is the total search compares its count with."""
    from megatron_ext.commands.search import _stated_size

    assert _stated_size(name) == stated
