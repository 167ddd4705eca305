"""The MoE part of the plan format: model.moe (Megatron-LM's --num-experts family) and the
per-layer expert degrees ep/etp, their JSON round trip and their one-line errors."""

from __future__ import annotations

import dataclasses
import re

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.plan import LayerStrategy, ParallelPlan
from megatron_ext.specs import ModelSpec, MoESpec

MOE = MoESpec(num_experts=4, router_topk=2, layer_freq=(0, 1, 0, 1), aux_loss_coeff=0.01)
MODEL = ModelSpec(name="tiny-moe", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                  num_attention_heads=4, num_query_groups=4, vocab_size=512, moe=MOE)


def _plan(dense: LayerStrategy, moe: LayerStrategy, model: ModelSpec = MODEL) -> ParallelPlan:
    layers = tuple(moe if model.is_moe_layer(i) else dense for i in range(model.num_layers))
    return ParallelPlan(world_size=4, pp=1, stages=((0, 4),), layers=layers, model=model,
                        micro_batch_size=4, global_batch_size=8, seq_length=32, precision="fp32")


def test_moe_plan_round_trips_and_dense_json_is_unchanged() -> None:
    plan = _plan(LayerStrategy(tp=2, sp=True, dp=2), LayerStrategy(tp=2, sp=True, dp=2, ep=2,
                                                                    etp=1))
    again = ParallelPlan.from_dict(plan.to_dict())
    assert again == plan
    assert again.model.moe is not None and again.model.moe.layer_freq == (0, 1, 0, 1)
    assert [again.model.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    moe_layer = again.layers[1]
    assert (moe_layer.ep, moe_layer.expert_tp, moe_layer.expert_dp) == (2, 1, 2)
    assert moe_layer.describe() == "tp2+sp dp2 ep2 etp1"
    dense = dataclasses.replace(MODEL, moe=None)
    data = _plan(LayerStrategy(dp=4), LayerStrategy(dp=4), dense).to_dict()
    assert "moe" not in data["model"] and "ep" not in data["layers"][0]


def test_int_layer_freq_as_megatron() -> None:
    model = dataclasses.replace(MODEL, moe=dataclasses.replace(MOE, layer_freq=2))
    assert [model.is_moe_layer(i) for i in range(4)] == [True, False, True, False]


@pytest.mark.parametrize(("dense", "moe", "model", "expected"), [
    (LayerStrategy(dp=4, ep=2), LayerStrategy(dp=4, ep=2), MODEL,
     "layers[0] is a dense layer but has ep=2"),
    (LayerStrategy(dp=4), LayerStrategy(dp=4, ep=3), MODEL, "ep=3 does not divide"),
    (LayerStrategy(tp=2, sp=True, dp=2), LayerStrategy(tp=2, sp=True, dp=2, ep=4), MODEL,
     "ep*etp=8 does not divide the layer's 4 ranks"),
    (LayerStrategy(tp=2, dp=2), LayerStrategy(tp=2, dp=2), MODEL, "needs sequence parallelism"),
    (LayerStrategy(dp=4), LayerStrategy(dp=4, etp=3), MODEL, "etp=3"),
])
def test_expert_degree_errors(dense: LayerStrategy, moe: LayerStrategy, model: ModelSpec,
                              expected: str) -> None:
    with pytest.raises(PlanError, match=re.escape(expected)) as err:
        _plan(dense, moe, model)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("edit", "expected"), [
    ({"layer_freq": [1, 0]}, "layer_freq has 2 entries but num_layers=4"),
    ({"layer_freq": [0, 0, 0, 0]}, "makes no layer MoE"),
    ({"router_topk": 5}, "router_topk=5 must be in"),
    ({"router_load_balancing_type": "aux"}, "router_load_balancing_type"),
])
def test_moe_spec_errors(edit: dict, expected: str) -> None:
    data = MODEL.to_dict()
    data["moe"] = {**data["moe"], **edit}
    with pytest.raises(PlanError, match=expected):
        ModelSpec.from_dict(data)


def test_moe_refuses_linear_bias() -> None:
    with pytest.raises(PlanError, match="--disable-bias-linear"):
        dataclasses.replace(MODEL, add_bias_linear=True)
