"""The search is exact under its memory budget: it matches a brute-force oracle on small cases,
and widening the space (ZeRO-3) or the memory never gives a slower plan.

The oracle (search_oracle.py) enumerates, without any pruning and with exact (unquantised)
memory, two strategies per stage at pp=1 and one per stage at pp=2 over every micro-batch size
and vocabulary layout; the search's space contains all of those layouts, so its plan must be at
least as fast. Comparisons are on cost/evaluate.py's iteration time, rel 1e-9 (float summation
order: the oracle sums n * per-layer cost, evaluate adds the layers one by one).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_ext.errors import InfeasiblePlanError
from megatron_ext.plan import PlanLayout
from megatron_ext.planner.cost.evaluate import evaluate
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.infeasible import min_memory_gib
from megatron_ext.planner.search import SearchOptions, search
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.presets import cluster_preset, model_preset
from tests.unit.search_oracle import check_against_evaluate, oracle

REL = 1e-9


def small_cost_model(
    name: str, layers: int, gbs: int, seq: int, memory_factor: float, *, zero3: bool, nodes=1
) -> CostModel:
    """`name` cut to `layers` layers on one 8-GPU A100 node, memory_factor x the least memory
    any layout needs (1.0 is the tightest feasible point)."""
    model = dataclasses.replace(model_preset(name), num_layers=layers, max_position_embeddings=8192)
    training = TrainingSpec(global_batch_size=gbs, seq_length=seq, allow_zero3=zero3)
    probe = CostModel(model, cluster_preset("dgx-a100-80g", num_nodes=nodes), training)
    memory = round(min_memory_gib(probe) * memory_factor, 2)
    return CostModel(
        model, cluster_preset("dgx-a100-80g", num_nodes=nodes, memory_gib=memory), training
    )


def searched_s(cm: CostModel) -> float:
    try:
        return search(cm, options=SearchOptions(explain_infeasible=False)).evaluation.iteration_s
    except InfeasiblePlanError:
        return math.inf


CASES = [
    (name, layers, gbs, seq, factor, zero3)
    for name, layers, gbs, seq in (
        ("llama2-7b", 6, 16, 4096),
        ("gpt3-1.3b", 4, 32, 2048),
        ("llama3-8b", 5, 8, 8192),
        ("llama2-13b", 4, 16, 2048),
    )
    for factor, zero3 in ((1.05, True), (1.3, True), (1.8, True), (1.3, False))
][:14]


@pytest.mark.parametrize(("name", "layers", "gbs", "seq", "factor", "zero3"), CASES)
def test_search_matches_brute_force(name, layers, gbs, seq, factor, zero3):
    cm = small_cost_model(name, layers, gbs, seq, factor, zero3=zero3)
    best = oracle(cm)
    assert best is not None
    check_against_evaluate(cm, best)  # the oracle scores what evaluate scores
    result = search(cm, options=SearchOptions(explain_infeasible=False))
    assert result.evaluation.feasible
    assert result.evaluation.iteration_s <= best.iteration_s * (1 + REL), (
        f"search {result.evaluation.iteration_s:.6f} s, brute force {best.iteration_s:.6f} s "
        f"({best.pp=}, {best.micro_batch_size=}, {best.vocab}, "
        f"{[s.describe() for s in best.layers]})"
    )


@settings(
    max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    name=st.sampled_from(["llama2-7b", "gpt3-1.3b", "llama3-8b", "llama2-13b", "llama2-70b"]),
    layers=st.sampled_from([4, 6, 8, 12]),
    gbs=st.sampled_from([8, 16, 32, 64]),
    seq=st.sampled_from([1024, 2048, 4096]),
    factor=st.floats(1.0, 1.6),
    more=st.floats(1.0, 1.3),
)
def test_wider_space_or_more_memory_is_never_slower(name, layers, gbs, seq, factor, more):
    cm = small_cost_model(name, layers, gbs, seq, factor, zero3=False)
    base = searched_s(cm)
    wider = dataclasses.replace(cm.training, allow_zero3=True)
    assert searched_s(CostModel(cm.model, cm.cluster, wider)) <= base * (1 + REL)
    bigger = dataclasses.replace(cm.cluster, memory_gib=round(cm.cluster.memory_gib * more, 2))
    assert searched_s(CostModel(cm.model, bigger, cm.training)) <= base * (1 + REL)


def test_no_recomputed_layer_could_keep_its_activations():
    """The DP rounds memory up to whole units; the exact repair then hands back what rounding
    lost: switching any recomputed layer of the plan to no recomputation no longer fits."""
    # 24 GiB: tight enough that the plan recomputes some layers under the A100-calibrated cost
    # model (at 36 GiB it now fits pp8 without recomputation, ZeRO-3 no longer being cheap).
    cm = CostModel(
        model_preset("llama2-70b"),
        cluster_preset("dgx-a100-80g", num_nodes=8, memory_gib=24),
        TrainingSpec(global_batch_size=64, seq_length=2048, allow_zero3=True),
    )
    plan = search(cm).plan
    recomputed = [i for i, s in enumerate(plan.layers) if s.recompute != "none"]
    assert recomputed, "the case is meant to be memory-tight"
    for i in recomputed:
        layers = list(plan.layers)
        layers[i] = dataclasses.replace(layers[i], recompute="none")
        ev = evaluate(
            cm,
            PlanLayout(pp=plan.pp,
            stages=plan.stages,
            layers=layers,
            vocab=plan.vocab,
            micro_batch_size=plan.micro_batch_size),
        )
        assert not ev.feasible, f"layer {i} fits without recomputation"
