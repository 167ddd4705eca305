"""Real inputs (tests/data) through plan-from-args, `megatron-ext args` and the HF reader.

Each Megatron-LM core_v0.16.1 launch script, model-flag file and GPT functional-test config must
give either a plan, unchanged, or a one-line refusal that starts with the flag it refuses, as
tests/data/megatron_lm/expected.json records. A refusal's message names the feature (the flag
table's text). When a flag becomes honoured (the training path implements it), its inputs turn
into plans and expected.json changes with it.

Each HuggingFace config.json must give a model whose parameter count matches the model card's
within 1%, or a one-line refusal naming the field. For mixture-of-experts models the count is the
card's total (every expert, the routers, shared experts and their gates, dense layers at their
own width), which only comes out right when experts, expert width, shared experts and the
dense/MoE layer pattern were all read correctly.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.flags import versions
from megatron_ext.flags.emit import megatron_values, plan_to_megatron_args
from megatron_ext.flags.parser import parse_megatron_args, plan_from_megatron_args
from megatron_ext.hf_config import model_from_hf_config
from megatron_ext.planner.cost.compute import model_parameters
from megatron_ext.presets import model_file_with_notes


@pytest.fixture(autouse=True)
def _core_v0_16_1_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The corpus is Megatron-LM core_v0.16.1's launch scripts: parse them with that catalog
    whatever megatron-core is installed (tests/unit/test_flag_versions.py covers core_v0.19.0's)."""
    monkeypatch.setattr(versions, "installed_megatron_core", lambda: "0.16.1")


DATA = Path(__file__).resolve().parents[1] / "data"
MEGATRON = DATA / "megatron_lm"
EXPECTED = json.loads((MEGATRON / "expected.json").read_text())
GPT2_BPE_VOCAB = 50257  # what pretrain_gpt.py reads from the GPT-2 vocab file the configs name


def _argv(name: str) -> list[str]:
    record = json.loads((MEGATRON / f"{name}.json").read_text())
    argv = list(record["argv"])
    if name.startswith("modelopt_conf/"):
        # the post-training launcher adds the tokenizer the file's TOKENIZER_MODEL names
        argv += ["--tokenizer-model", "/tokenizer"]
    return argv


def _world_size(argv: list[str]) -> int:
    """8 ranks (the CI's 8 GPUs), fewer when the batch does not split over 8; MoE configs also
    need the expert groups (etp x ep x pp) to divide the world, as in Megatron-LM."""
    ns = parse_megatron_args(argv)
    model_parallel = (ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size
                      * ns.context_parallel_size)
    if ns.num_experts:
        expert = ((ns.expert_tensor_parallel_size or ns.tensor_model_parallel_size)
                  * ns.expert_model_parallel_size * ns.pipeline_model_parallel_size)
        model_parallel = math.lcm(model_parallel, expert)
    replicas = 8 // model_parallel if 8 % model_parallel == 0 else 1
    micro_batches = (ns.global_batch_size or 8) // (ns.micro_batch_size or 1)
    return model_parallel * math.gcd(replicas, micro_batches)


def test_corpus_is_complete():
    files = {str(p.relative_to(MEGATRON))[:-5] for p in MEGATRON.glob("*/*.json")}
    assert files == set(EXPECTED)
    assert len([n for n in files if n.startswith("functional_tests/")]) == 142
    assert len([n for n in files if n.startswith("functional_tests_moe/")]) == 50
    assert len([n for n in files if n.startswith("examples/")]) == 3


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_megatron_lm_input(name: str) -> None:
    argv, expected = _argv(name), EXPECTED[name]
    try:
        world = _world_size(argv)
        ns = parse_megatron_args(argv, world_size=world)
        plan = plan_from_megatron_args(ns, world,
                                       vocab_size=None if ns.vocab_size else GPT2_BPE_VOCAB)
    except PlanError as err:
        message = str(err)
        assert expected != "plan", f"{name} should give a plan: {message}"
        assert message.startswith(expected) and "\n" not in message, message
        if " is not supported by megatron_ext" in message:
            feature = message.split(": ", 1)[1].split(" is not supported")[0]
            assert feature  # the flag table names what is unsupported
        return
    assert expected == "plan", f"{name} gave a plan, expected a refusal starting {expected!r}"
    # unchanged: the plan is the one the flags describe, and `megatron-ext args` prints flags
    # that plan-from-args turns back into the same plan
    assert plan.world_size == world
    assert plan.global_batch_size == (ns.global_batch_size or ns.micro_batch_size * world)
    assert plan.model.num_layers == ns.num_layers
    assert (plan.model.moe is not None) == bool(ns.num_experts)
    if not megatron_values(plan).reasons:  # uniform in Megatron-LM's sense (MoE layers: ep/etp)
        again = parse_megatron_args(list(plan_to_megatron_args(plan).argv), world_size=world)
        assert plan_from_megatron_args(again, world) == plan


def test_gpt_and_llama_configs_that_use_only_supported_features_plan():
    """Done-when of issue 13: the plain GPT/Llama functional tests and launch scripts plan."""
    plain = [n for n, e in EXPECTED.items() if e == "plan"]
    assert "functional_tests/gpt3_mcore_tp1_pp2" in plain
    assert "functional_tests/gpt3_mcore_te_tp2_pp2_cp2" in plain
    assert "modelopt_conf/meta-llama__Llama-3.1-8B-Instruct" in plain
    assert "modelopt_conf/Qwen__Qwen2.5-7B-Instruct" in plain


def test_moe_functional_tests_and_model_files_plan():
    """Megatron-LM's MoE functional tests that use only supported features give plans with their
    experts and expert degrees; Qwen3-30B-A3B's model-flag file plans."""
    plain = {n for n, e in EXPECTED.items() if e == "plan"}
    assert "modelopt_conf/Qwen__Qwen3-30B-A3B" in plain
    name = "functional_tests_moe/gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel"
    assert name in plain
    ns = parse_megatron_args(_argv(name), world_size=8)
    plan = plan_from_megatron_args(ns, 8, vocab_size=GPT2_BPE_VOCAB)
    assert plan.model.moe is not None and plan.model.moe.num_experts == 4
    # its flags say tp 4 (not the 2 of its name), ep 2, etp 2: experts fold inside attention TP
    assert {(s.tp, s.sp, s.ep, s.expert_tp, s.expert_dp) for s in plan.layers} == {
        (4, True, 2, 2, 1)}
    assert len([n for n in plain if n.startswith("functional_tests_moe/")]) == 20


def test_llama31_flags_reach_the_plan():
    ns = parse_megatron_args(_argv("modelopt_conf/meta-llama__Llama-3.1-8B-Instruct"),
                             world_size=1)
    model = plan_from_megatron_args(ns, 1, vocab_size=128256).model
    assert (model.rotary_base, model.rope_scaling, model.rope_scaling_factor) == (500000, True,
                                                                                 8.0)
    qwen = parse_megatron_args(_argv("modelopt_conf/Qwen__Qwen2.5-7B-Instruct"), world_size=1)
    model = plan_from_megatron_args(qwen, 1, vocab_size=152064).model
    assert model.add_qkv_bias and model.rotary_base == 1000000


# HuggingFace configs: the parameter count the model card states (billions), or the refused
# field. Model cards: meta-llama, mistralai, Qwen, codellama on huggingface.co.
HF_EXPECTED: dict[str, float | str] = {
    "Llama-2-7b-hf": 6.74, "Llama-2-70b-hf": 68.98, "CodeLlama-7b-hf": 6.74,
    "Llama-3.1-8B": 8.03, "Llama-3.1-70B": 70.55, "Llama-3.2-1B": 1.24,
    "Mistral-7B-v0.3": 7.25, "Qwen2-0.5B": 0.49, "Qwen2-7B": 7.62, "Qwen2.5-3B": 3.09,
    "Qwen3-0.6B": 0.6, "Qwen3-1.7B": 1.7,
    # as transformers 5 saves it (rope_parameters, dtype, layer_types): 72.7B on the card
    "Qwen2.5-72B-Instruct": 72.7,
    # MoE, total parameters: mistralai/Mixtral-8x7B-v0.1 46.7B, Qwen/Qwen1.5-MoE-A2.7B 14.3B,
    # deepseek-ai/deepseek-moe-16b-base 16.4B, Qwen/Qwen3-30B-A3B 30.5B, Qwen/Qwen2-57B-A14B
    # 57.4B (the Hub's safetensors count; the card says 57B)
    "Mixtral-8x7B-v0.1": 46.7, "Qwen1.5-MoE-A2.7B": 14.3, "deepseek-moe-16b": 16.4,
    "Qwen3-30B-A3B": 30.5, "Qwen2-57B-A14B": 57.4,
    # MLA + MoE, total parameters: deepseek-ai/DeepSeek-V2-Lite 15.7B, deepseek-ai/DeepSeek-V3
    # 671B (the main model; the card's 685B adds the 14B multi-token-prediction module, which
    # this config does not ask for and megatron_ext refuses)
    "DeepSeek-V2-Lite": 15.7, "DeepSeek-V3": 671.0,
    # moonshotai/Kimi-K2-Instruct's YaRN beta_fast 1.0 has no Megatron-LM flag (MLA fixes 32):
    # refused by name; test_kimi_k2_style_config_plans reads it with Megatron's 32
    "Kimi-K2-Instruct": "rope_scaling.beta_fast=1.0",
    "Mistral-7B-v0.1": "sliding_window=4096",
    "gemma-2b": "model_type 'gemma'", "gemma-2-2b": "model_type 'gemma2'",
    "gemma-2-9b": "model_type 'gemma2'", "gemma-2-27b": "model_type 'gemma2'",
    "gemma-3-1b-it": "model_type 'gemma3_text'", "gpt-j-6b": "model_type 'gptj'",
    "phi-2": "model_type 'phi-msft'", "gpt2": "activation_function='gelu_new'",
    "OLMo-2-1124-7B": "model_type 'olmo2'", "OLMo-2-1124-13B": "model_type 'olmo2'",
    "starcoder2-7b": "sliding_window=4096",
    "Phi-3.5-mini-instruct": "rope_scaling type 'longrope'",
    "Phi-4-mini-instruct": "rope_scaling type 'longrope'",
}


def test_hf_corpus_is_complete():
    assert {p.stem for p in (DATA / "hf_configs").glob("*.json")} == set(HF_EXPECTED)


@pytest.mark.parametrize("name", sorted(HF_EXPECTED))
def test_hf_config(name: str) -> None:
    expected = HF_EXPECTED[name]
    path = DATA / "hf_configs" / f"{name}.json"
    if isinstance(expected, str):
        with pytest.raises(PlanError) as err:
            model_file_with_notes(path)
        message = str(err.value)
        assert message.startswith(f"{name}: config.json {expected}") and "\n" not in message
        return
    model, notes = model_file_with_notes(path)
    billions = _parameters(model) / 1e9
    # 1% or the card's rounding (0.6B, 1.7B): the same model, not a misread one
    assert abs(billions - expected) <= max(0.01 * expected, 0.025), billions
    data = json.loads(path.read_text())
    for key in data:  # every field mapped onto the spec or noted with a reason
        assert key in _mapped_fields() or any(n.startswith(f"{key}: ") for n in notes), key


def test_kimi_k2_style_config_plans():
    """Kimi K2 (model_type kimi_k2, DeepSeek-V3's model class: MLA + 384 experts, top-8, one
    shared expert, one dense layer) read as DeepSeek-V3 is; with the YaRN beta_fast Megatron-LM
    can express (32, MLATransformerConfig's fixed value; the parameters do not depend on it) it
    becomes a plan-ready model of the Hub checkpoint's size: 1,026.47B parameters (the sum of
    the published safetensors' tensor sizes, which the model card rounds to 1T) and ~32B active
    per token (the card's figure: 8 of 384 routed experts, the shared one, attention, the dense
    first layer and the embeddings)."""
    from megatron_ext.hf_config.read import model_from_hf_config
    from megatron_ext.planner.cost.compute import expert_params

    data = json.loads((DATA / "hf_configs" / "Kimi-K2-Instruct.json").read_text())
    data["rope_scaling"] = {**data["rope_scaling"], "beta_fast": 32.0}
    hf = model_from_hf_config(data, "Kimi-K2-Instruct")
    model = hf.spec
    assert model.mla is not None and model.moe is not None
    assert (model.mla.q_lora_rank, model.mla.kv_lora_rank, model.mla.rope_type) == (1536, 512,
                                                                                    "yarn")
    assert (model.moe.num_experts, model.moe.router_topk, model.num_layers) == (384, 8, 61)
    assert sum(model.is_moe_layer(i) for i in range(61)) == 60
    total = _parameters(model)
    assert abs(total / 1e9 - 1026.47) <= 0.01 * 1026.47, total
    # active: every parameter but the 376 routed experts a token does not use, per MoE layer
    per_expert = expert_params(model) / model.moe.num_experts
    active = total - 60 * (384 - 8) * per_expert
    assert abs(active / 1e9 - 32.0) <= 0.05 * 32.0, active
    assert any(n.startswith("model_type: read as 'deepseek_v3'") for n in hf.notes)


def _parameters(model) -> int:
    """All parameters; an MoE layer's MLP is its experts (E x the gated MLP of the expert width),
    its router (E x h), its shared experts and their sigmoid gate (h). Counted here from the
    dense model of the same shape, and the cost model's own count must agree."""
    total = model_parameters(model)
    if model.moe is None:
        return total
    total = model_parameters(dataclasses.replace(model, moe=None))
    moe, h = model.moe, model.hidden_size
    gated = 3 if model.activation == "swiglu" else 2
    routed = moe.num_experts * (gated * h * moe.expert_ffn_hidden_size(model) + h)
    shared = gated * h * moe.shared_expert_intermediate_size + (h if moe.shared_expert_gate else 0)
    dense_mlp = gated * h * model.ffn_hidden_size
    moe_layers = sum(model.is_moe_layer(i) for i in range(model.num_layers))
    counted = total + moe_layers * (routed + shared - dense_mlp)
    assert model_parameters(model) == counted, (model_parameters(model), counted)
    return counted


def _mapped_fields() -> set[str]:
    from megatron_ext.hf_config import _MAPPED

    return set(_MAPPED)


def test_hf_fields_reach_the_spec():
    read = {n: model_file_with_notes(DATA / "hf_configs" / f"{n}.json")[0]
            for n in ("Llama-3.2-1B", "Qwen2.5-3B", "Qwen3-0.6B", "Llama-2-7b-hf")}
    llama32 = read["Llama-3.2-1B"]
    assert llama32.tied_embeddings and llama32.rope_scaling
    assert (llama32.rotary_base, llama32.rope_scaling_factor) == (500000, 32.0)
    assert read["Qwen2.5-3B"].add_qkv_bias and read["Qwen2.5-3B"].norm_epsilon == 1e-6
    assert read["Qwen3-0.6B"].qk_layernorm and read["Qwen3-0.6B"].kv_channels == 128
    assert not read["Llama-2-7b-hf"].tied_embeddings and read["Llama-2-7b-hf"].rotary_base == 10000


def test_hf_defaults_and_unknown_fields():
    base = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100, "rms_norm_eps": 1e-6}
    assert model_from_hf_config(base, "x").spec.tied_embeddings  # PretrainedConfig's default
    assert not model_from_hf_config({**base, "model_type": "llama"}, "x").spec.tied_embeddings
    with pytest.raises(PlanError, match="field 'new_thing' is not one megatron_ext knows"):
        model_from_hf_config({**base, "new_thing": 1}, "x")
    with pytest.raises(PlanError, match="rope_scaling.low_freq_factor=2"):
        model_from_hf_config({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8,
                                                        "low_freq_factor": 2}}, "x")
    with pytest.raises(PlanError, match="attention_bias=true without mlp_bias"):
        model_from_hf_config({**base, "attention_bias": True}, "x")


def test_args_emit_and_read_back_the_new_model_fields(tmp_path: Path):
    from megatron_ext.planner.cost.model import CostModel
    from megatron_ext.planner.search import SearchOptions, search
    from megatron_ext.planner.training import TrainingSpec
    from megatron_ext.presets import cluster_preset

    model = model_file_with_notes(DATA / "hf_configs" / "Qwen3-0.6B.json")[0]
    cm = CostModel(model, cluster_preset("dgx-h100"),
                   TrainingSpec(global_batch_size=16, seq_length=2048))
    plan = search(cm, options=SearchOptions(uniform_only=True)).plan
    argv = plan_to_megatron_args(plan).argv
    assert "--qk-layernorm" in argv and "--rotary-base" in argv
    back = plan_from_megatron_args(parse_megatron_args(list(argv), world_size=plan.world_size),
                                   plan.world_size)
    assert back.model == plan.model.__class__.from_dict({**plan.model.to_dict(),
                                                         "name": "custom"})


PLANNED_HF = sorted(n for n, e in HF_EXPECTED.items() if not isinstance(e, str))


@pytest.mark.parametrize("name", PLANNED_HF)
def test_hf_model_round_trips_through_args(name: str) -> None:
    """`megatron-ext args` prints every field the config set (RoPE base and scaling, biases, q/k
    norms, norm epsilon) and plan-from-args reads the same model back."""
    from megatron_ext.plan import LayerStrategy, ParallelPlan

    model = model_file_with_notes(DATA / "hf_configs" / f"{name}.json")[0]
    plan = ParallelPlan(world_size=1, pp=1, stages=((0, model.num_layers),),
                        layers=(LayerStrategy(),) * model.num_layers, model=model,
                        micro_batch_size=1, global_batch_size=1, seq_length=1024,
                        precision="bf16")
    argv = list(plan_to_megatron_args(plan).argv)
    back = plan_from_megatron_args(parse_megatron_args(argv, world_size=1), 1).model
    assert back.to_dict() == {**model.to_dict(), "name": "custom"}
