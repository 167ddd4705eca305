"""HuggingFace configs as transformers writes them. The installed transformers 5 (the dev extra;
nothing is installed or downloaded here) builds each supported family's default config and the
published shapes of tests/data/hf_configs (`AutoConfig.for_model(model_type, **shape)`); each is
saved in the 5.x format (`rope_parameters`, `dtype`, per-layer `layer_types`, `to_dict()` as is)
and in the 4.x one (top-level `rope_theta` / `rope_scaling`, `torch_dtype`, no `layer_types`).
Both files must read to the same model, with the parameter count of transformers' own model of
that config (built on the meta device: no weights are allocated), or be refused with the same
reason. Families refused by model_type (Gemma, GPT-J, OLMo 2, phi-2) never reach a config class.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_ext.errors import PlanError
from megatron_ext.hf_config.fields import REFUSED_FAMILIES, check_unknown
from megatron_ext.planner.cost.compute import model_parameters
from megatron_ext.presets import model_file_with_notes

DATA = Path(__file__).resolve().parents[1] / "data" / "hf_configs"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "starcoder2", "gpt2", "mixtral",
            "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
# shipped files of families transformers has a class for (DeepSeek-MoE is remote code)
PUBLISHED = sorted(p.stem for p in DATA.glob("*.json")
                   if json.loads(p.read_text()).get("model_type") in FAMILIES)
# the one-line refusal's start, the same in both formats but for the RoPE field's name
REFUSED = {
    "default-mistral": "sliding_window=4096", "Mistral-7B-v0.1": "sliding_window=4096",
    "default-starcoder2": "hidden_act='gelu_pytorch_tanh'",
    "starcoder2-7b": "sliding_window=4096",
    "default-gpt2": "activation_function='gelu_new'", "gpt2": "activation_function='gelu_new'",
    # transformers' defaults: no experts per token / one multi-token-prediction layer
    "default-deepseek_v2": "num_experts_per_tok=None",
    "default-deepseek_v3": "num_nextn_predict_layers=1",
    "Phi-3.5-mini-instruct": "type 'longrope'", "Phi-4-mini-instruct": "type 'longrope'",
}


def test_transformers_is_5() -> None:
    assert transformers.__version__.split(".")[0] == "5", transformers.__version__


def test_every_family_read_has_a_case() -> None:
    from megatron_ext.hf_config.fields import FAMILIES as READ

    assert set(READ) - set(FAMILIES) == {"deepseek"}  # remote code: no transformers class
    assert not set(REFUSED_FAMILIES) & set(FAMILIES)


def _config(case: str) -> transformers.PretrainedConfig:
    if case.startswith("default-"):
        return AutoConfig.for_model(case.removeprefix("default-"))
    shape = json.loads((DATA / f"{case}.json").read_text())
    if shape["model_type"] == "deepseek_v3":
        # the file asks for no multi-token-prediction module (megatron_ext refuses one);
        # transformers' default of 1 builds no MTP layer either, so the counts compare as is
        shape.setdefault("num_nextn_predict_layers", 0)
    return AutoConfig.for_model(shape.pop("model_type"), **shape)


def _as_4x(data: dict[str, Any]) -> dict[str, Any]:
    """The same config as transformers 4.x wrote it."""
    out = dict(data)
    params = dict(out.pop("rope_parameters", None) or {})
    if params:
        out["rope_theta"] = params.pop("rope_theta")
        if "partial_rotary_factor" in params:
            out["partial_rotary_factor"] = params.pop("partial_rotary_factor")
        out["rope_scaling"] = None if params.get("rope_type") == "default" else params
    out["torch_dtype"] = out.pop("dtype")
    out.pop("layer_types", None)
    if out["model_type"] == "qwen3_moe":  # 4.x spelt it num_experts
        out["num_experts"] = out.pop("num_local_experts")
    return out


def _read(path: Path) -> tuple[Any, str | None]:
    try:
        return model_file_with_notes(path)[0], None
    except PlanError as err:
        return None, str(err)


@pytest.mark.parametrize("case", [f"default-{f}" for f in FAMILIES] + PUBLISHED)
def test_both_formats_read_to_the_same_model(case: str, tmp_path: Path) -> None:
    config = _config(case)
    v5 = config.to_dict()
    assert "rope_parameters" in v5 or config.model_type == "gpt2"  # the 5.x format indeed
    models = {}
    for fmt, data in (("v5", v5), ("v4", _as_4x(v5))):
        path = tmp_path / fmt / f"{case}.json"
        path.parent.mkdir()
        path.write_text(json.dumps(data, indent=2))
        models[fmt] = _read(path)
    if case in REFUSED:
        for fmt, (_, message) in models.items():
            assert message is not None and "\n" not in message, (fmt, message)
            assert message.startswith(f"{case}: config.json "), message
            assert REFUSED[case] in message, (fmt, message)
        return
    (v5_model, v5_err), (v4_model, v4_err) = models["v5"], models["v4"]
    assert v5_err is None and v4_err is None, (v5_err, v4_err)
    assert v5_model == v4_model
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config)
    assert model_parameters(v5_model) == sum(p.numel() for p in reference.parameters())
    if not case.startswith("default-"):  # the shipped 4.x file: the same model
        shipped = model_file_with_notes(DATA / f"{case}.json")[0]
        assert {**shipped.to_dict(), "name": case} == {**v5_model.to_dict(), "name": case}


def test_qwen25_72b_instruct_as_transformers_5_saves_it() -> None:
    path = DATA / "Qwen2.5-72B-Instruct.json"
    data = json.loads(path.read_text())
    assert data["layer_types"] == ["full_attention"] * 80 and "rope_parameters" in data
    model = model_file_with_notes(path)[0]
    assert round(model_parameters(model) / 1e9, 1) == 72.7
    assert (model.rotary_base, model.add_qkv_bias, model.tied_embeddings) == (1000000, True,
                                                                            False)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    assert model_parameters(model) == sum(p.numel() for p in reference.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_every_field_transformers_writes_is_known_to_the_family(family: str) -> None:
    """Refused configs stop at their first refusal; every field of the family's 5.x and 4.x
    files is still one the reader maps or ignores for that family (not only for some other)."""
    v5 = AutoConfig.for_model(family).to_dict()
    for data in (v5, _as_4x(v5)):
        check_unknown(data, family, "x")
