"""Multi-latent attention (MLA) in the plan, the flags, the cost model and the search.

Parameter counts are checked three ways: megatron-core's own MLA modules (tests/dist/
test_mla_parity.py), transformers' DeepSeek-V2/V3 models (test_hf_transformers.py), and the
model cards (test_real_inputs.py; here the Megatron-LM flag files of DeepSeek-R1 and Kimi-K2).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.flags.parser import parse_megatron_args, plan_from_megatron_args
from megatron_ext.plan import LayerStrategy, ParallelPlan
from megatron_ext.planner.cost import mla as mla_cost
from megatron_ext.planner.cost.compute import (
    attention_forward_flops,
    layer_matmul_params,
    layer_params,
    model_parameters,
    moe_model_parameters,
)
from megatron_ext.presets import MODEL_PRESETS
from megatron_ext.specs import MLASpec, ModelSpec

MEGATRON = Path(__file__).resolve().parents[1] / "data" / "megatron_lm"


def _model(**mla: object) -> ModelSpec:
    return dataclasses.replace(MODEL_PRESETS["tiny-llama"], num_query_groups=4,
                               qk_layernorm=True, mla=MLASpec(**{  # type: ignore[arg-type]
                                   "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 8,
                                   "qk_pos_emb_head_dim": 4, "v_head_dim": 6, **mla}))


def test_plan_json_round_trip_and_absent_is_standard_attention() -> None:
    model = _model(rope_type="rope")
    data = json.loads(json.dumps(model.to_dict()))
    assert data["mla"]["q_lora_rank"] == 24 and ModelSpec.from_dict(data) == model
    no_q = _model(q_lora_rank=None)
    assert ModelSpec.from_dict(no_q.to_dict()).mla.q_lora_rank is None  # type: ignore[union-attr]
    assert "mla" not in MODEL_PRESETS["tiny-llama"].to_dict()  # v1 plans unchanged


@pytest.mark.parametrize(("change", "expected"), [
    ({"num_query_groups": 2}, "model.num_query_groups=2 with model.mla"),
    ({"rope_scaling": True}, "model.rope_scaling=true with model.mla"),
    ({"add_qkv_bias": True}, "model.add_qkv_bias=true with model.mla"),
])
def test_model_level_refusals(change: dict, expected: str) -> None:
    with pytest.raises(PlanError) as err:
        dataclasses.replace(_model(), **change)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


@pytest.mark.parametrize(("data", "expected"), [
    ({"q_lora_rank": 0}, "model.mla.q_lora_rank=0 must be >= 1"),
    ({"qk_pos_emb_head_dim": 3}, "model.mla.qk_pos_emb_head_dim=3 must be even"),
    ({"rope_type": "ntk"}, "model.mla.rope_type='ntk'"),
    ({"kv_rank": 4}, "model.mla.kv_rank is not a known field"),
])
def test_spec_refusals(data: dict, expected: str) -> None:
    with pytest.raises(PlanError) as err:
        MLASpec.from_dict(data)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_parameters_and_flops_formulas() -> None:
    """By hand for the tiny model: h=64, n=4, r_q=24, r_kv=16, d_nope=8, d_rope=4, d_v=6."""
    model = _model()
    attention = 64 * 24 + 24 * 4 * 12 + 64 * (16 + 4) + 16 * 4 * (8 + 6) + 4 * 6 * 64
    mlp = 3 * 64 * 176
    assert layer_matmul_params(model) == attention + mlp
    assert layer_params(model) == attention + (24 + 16) + mlp + 2 * 64  # latent + layer norms
    # QK^T over d_q = 12, AV over d_v = 6: the causal 2 b s^2 q with q = n (12 + 6) / 2
    assert attention_forward_flops(model, 1, 128, 1) == 2.0 * 128**2 * 4 * 9
    gemms = mla_cost.gemms(model, 2)
    assert sum(2 * k * n for k, n in gemms) == pytest.approx(2 * attention / 2)


def _flag_file_model(name: str, drop: tuple[str, ...]) -> ModelSpec:
    argv = json.loads((MEGATRON / "modelopt_conf" / f"{name}.json").read_text())["argv"]
    argv = [a for a in argv if a not in drop] + ["--tokenizer-model", "/tokenizer"]
    return plan_from_megatron_args(parse_megatron_args(argv, world_size=1), 1,
                                   vocab_size=163840 if "Kimi" in name else 129280).model


@pytest.mark.parametrize(("name", "total", "active", "rounding"), [
    # deepseek-ai/DeepSeek-R1: 671B total (without the MTP module), 37B activated
    ("deepseek-ai__DeepSeek-R1", 671.0, 37.0, 0.01),
    # moonshotai/Kimi-K2-Instruct: "1T" total, "32B" activated (one significant figure: 5%)
    ("moonshotai__Kimi-K2-Instruct", 1000.0, 32.0, 0.05),
])
def test_megatron_flag_files_count_the_model_cards(name: str, total: float, active: float,
                                                   rounding: float) -> None:
    """Megatron-LM's own flag files of these MLA + MoE models (less the --moe-layer-recompute
    they add, a recompute switch megatron_ext refuses) give the card's total and active
    parameters (active: the attention, shared and top-k experts, embeddings)."""
    model = _flag_file_model(name, ("--moe-layer-recompute",))
    assert model.mla is not None and model.mla.q_lora_rank == 1536
    assert abs(model_parameters(model) / 1e9 - total) <= rounding * total
    assert abs(moe_model_parameters(model, active=True) / 1e9 - active) <= 0.05 * active


@pytest.mark.parametrize(("argv", "expected"), [
    (["--tensor-model-parallel-size", "8"], "--tensor-model-parallel-size=8 does not divide "
     "--num-attention-heads=12: multi-latent attention splits its heads over tensor "
     "parallelism; use a tp that divides the heads"),
    (["--group-query-attention", "--num-query-groups", "4"], "--group-query-attention with "
     "--multi-latent-attention"),
    (["--rope-type", "rope"], "--rope-type rope with --multi-latent-attention needs "
     "--no-rope-fusion"),
])
def test_flag_refusals(argv: list[str], expected: str) -> None:
    base = ["--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "12",
            "--max-position-embeddings", "128", "--seq-length", "96", "--micro-batch-size", "1",
            "--vocab-size", "100", "--multi-latent-attention", "--kv-lora-rank", "16",
            "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8"]
    with pytest.raises(PlanError) as err:
        parse_megatron_args(base + argv, world_size=24)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


def test_mla_only_flag_without_mla_is_refused() -> None:
    with pytest.raises(PlanError, match=r"^--q-lora-rank is read only by multi-latent"):
        parse_megatron_args(["--num-layers", "2", "--hidden-size", "64",
                             "--num-attention-heads", "4", "--max-position-embeddings", "64",
                             "--seq-length", "64", "--micro-batch-size", "1",
                             "--q-lora-rank", "16"], world_size=1)


def _plan(model: ModelSpec, strategy: LayerStrategy, world: int) -> ParallelPlan:
    return ParallelPlan(world_size=world, pp=1, stages=((0, model.num_layers),),
                        layers=(strategy,) * model.num_layers, model=model,
                        micro_batch_size=4, global_batch_size=4, seq_length=64,
                        precision="fp32")


def test_plan_refuses_heads_split_and_ulysses() -> None:
    with pytest.raises(PlanError, match=r"tp=8 does not divide num_attention_heads=4; "
                                        r"multi-latent attention splits its heads over tp"):
        _plan(_model(), LayerStrategy(tp=8, dp=1), 8)
    with pytest.raises(PlanError, match=r"ulysses=2 with model.mla"):
        _plan(_model(), LayerStrategy(ulysses=2, dp=2), 4)


def test_runtime_needs_te_for_cp_and_divisible_latents() -> None:
    from megatron_ext.megatron_adapter.mla_support import check_mla_support

    with pytest.raises(PlanError, match=r"cp=2 with model.mla: context parallelism"):
        check_mla_support(_plan(_model(), LayerStrategy(cp=2, dp=2), 4), use_te=False)
    odd = _model(q_lora_rank=18, kv_lora_rank=16)  # 18 % 4 != 0
    with pytest.raises(PlanError, match=r"tp=4 does not divide model.mla q_lora_rank=18"):
        check_mla_support(_plan(odd, LayerStrategy(tp=4, dp=1), 4), use_te=False)
    check_mla_support(_plan(odd, LayerStrategy(tp=4, dp=1), 4), use_te=True)  # replicated


def test_search_space_has_no_ulysses_for_mla() -> None:
    from megatron_ext.planner.space import layer_strategies
    from megatron_ext.planner.training import TrainingSpec

    training = TrainingSpec(global_batch_size=8, seq_length=4096, allow_ulysses=True)
    table = layer_strategies(_model(), training, width=8, nvlink_gpus=8, micro_batch_size=8)
    assert set(table.ulysses.tolist()) == {1} and {1, 2, 4} <= set(table.tp.tolist())
    assert 2 in set(table.cp.tolist())


def test_tensor_parallel_mla_without_te_runs_on_the_layerwise_backend() -> None:
    """megatron-core's local MLA spec loses gradient under TP (docs/mla.md): uniform MLA plans
    with tp > 1 and no Transformer Engine go to the layerwise runtime, which fixes it."""
    from megatron_ext.megatron_adapter.training.select import plan_backend
    from megatron_ext.plan import VocabStrategy

    tp2 = dataclasses.replace(_plan(_model(), LayerStrategy(tp=2, dp=2), 4),
                              vocab=VocabStrategy(tp=2))
    assert plan_backend(tp2, use_transformer_engine=False) == "layerwise"
    assert plan_backend(tp2, use_transformer_engine=True) == "stock"
    assert plan_backend(_plan(_model(), LayerStrategy(dp=4), 4),
                        use_transformer_engine=False) == "stock"
