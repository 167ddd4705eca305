"""MoE in the cost model and the search: terms against hand calculations, the kind-aware DP and
partition against enumeration, and the searches choosing expert layouts.

Hand calculations use tiny-moe's shape (hidden 64, 4 heads of 16, GQA off, ffn 128, swiglu,
RMSNorm, 4 experts top-2, layers 0/2 dense and 1/3 MoE, no biases)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from megatron_ext.plan import LayerStrategy, PlanLayout, VocabStrategy
from megatron_ext.planner.cost import moe as M
from megatron_ext.planner.cost.compute import model_flops_per_token, model_parameters
from megatron_ext.planner.cost.evaluate import evaluate
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.dp import layer_dp
from megatron_ext.planner.partition import best_partition, partition_objective
from megatron_ext.planner.search import SearchOptions, search
from megatron_ext.planner.space import StrategyTable, layer_strategies
from megatron_ext.planner.training import DEFAULT_MOE_IMBALANCE, TrainingSpec
from megatron_ext.planner.uniform import search_uniform
from megatron_ext.presets import MODEL_PRESETS
from megatron_ext.specs import ClusterSpec, LinkSpec, ModelSpec, MoESpec

TINY = MODEL_PRESETS["tiny-moe"]
# tiny-moe by hand: attention h(q + 2kv) + q h = 64*192 + 64*64, two RMSNorms 2*64,
# router 4*64, experts 4 * 64*128*3 (fc1 gate+up, fc2), dense MLP 64*128*3.
ATTN_NORMS = 64 * 192 + 64 * 64 + 2 * 64  # 16512
ROUTER = 256
EXPERTS = 4 * 64 * 128 * 3  # 98304
DENSE_MLP = 64 * 128 * 3  # 24576


def _cluster(gpus: int, nodes: int = 1, memory_gib: float = 80.0) -> ClusterSpec:
    return ClusterSpec(name="test", num_nodes=nodes, gpus_per_node=gpus, memory_gib=memory_gib,
                       peak_flops=1e15,
                       intra_node=LinkSpec(bandwidth_bytes_per_s=100e9, latency_s=0.0),
                       inter_node=LinkSpec(bandwidth_bytes_per_s=10e9, latency_s=0.0))


def test_parameter_counts_total_and_active() -> None:
    assert M.moe_layer_params(TINY) == ATTN_NORMS + ROUTER + EXPERTS
    assert M.moe_layer_params(TINY, active=True) == ATTN_NORMS + ROUTER + EXPERTS // 2
    embeddings = 2 * 512 * 64 + 64  # untied input and output layers, final norm
    want = 2 * (ATTN_NORMS + DENSE_MLP) + 2 * (ATTN_NORMS + ROUTER + EXPERTS) + embeddings
    assert model_parameters(TINY) == want
    # Published sizes: Mixtral-8x7B 46.7B total / 12.9B active, DeepSeekMoE-16B 16.4B / 2.8B.
    assert model_parameters(MODEL_PRESETS["mixtral-8x7b"]) == pytest.approx(46.70e9, rel=1e-3)
    assert M.moe_model_parameters(MODEL_PRESETS["mixtral-8x7b"], active=True) == pytest.approx(
        12.88e9, rel=1e-3)
    assert model_parameters(MODEL_PRESETS["deepseek-moe-16b"]) == pytest.approx(16.38e9, rel=1e-3)


def test_mfu_flops_count_active_experts() -> None:
    s = 256
    matmul_attn = 64 * 192 + 64 * 64
    dense_layer = 6 * (matmul_attn + DENSE_MLP) + 6 * s * 64
    moe_layer = 6 * (matmul_attn + ROUTER + 2 * 64 * 128 * 3) + 6 * s * 64
    want = 2 * dense_layer + 2 * moe_layer + 6 * 64 * 512
    assert model_flops_per_token(TINY, s) == pytest.approx(want, rel=1e-12)


def _moe_costs(strategy: LayerStrategy, *, gpus: int = 4, training: TrainingSpec | None = None,
               mbs: int = 4):
    cm = CostModel(TINY, _cluster(gpus), training or TrainingSpec(global_batch_size=8,
                                                                   seq_length=256))
    table = StrategyTable.of([strategy])
    return cm, table, M.moe_layer_costs(cm, table, mbs)


@pytest.mark.parametrize(("zero", "dense_per_param", "expert_per_param"), [
    (0, 18.0, 18.0),  # bf16: weight 2 + main grad 4 + master 4 + Adam 8
    (1, 6.0 + 12.0 / 4, 6.0 + 12.0 / 2),  # master + Adam over d = 4 and over expert-DP = 2
])
def test_moe_state_memory_by_hand(zero: int, dense_per_param: float,
                                  expert_per_param: float) -> None:
    _, _, costs = _moe_costs(LayerStrategy(dp=4, ep=2, zero=zero))
    want = (ATTN_NORMS + ROUTER) * dense_per_param + EXPERTS / 2 * expert_per_param
    assert float(costs.state_bytes[0]) == pytest.approx(want, rel=1e-12)


def test_routed_activation_memory_by_hand() -> None:
    """ep=2 minus ep=1 is zero (rows per rank do not depend on ep); the MoE layer minus the
    dense layer is the routed tensors minus the dense MLP's intermediates."""
    training = TrainingSpec(global_batch_size=8, seq_length=256, moe_imbalance=1.0)
    cm, table, moe = _moe_costs(LayerStrategy(dp=4, ep=2), training=training)
    dense = cm.layer_costs(table, 4)
    tokens = 1 * 256  # mbs 4 over dp 4, seq 256, no cp/tp
    routed = tokens * 2  # top-2, balanced
    e = 2
    want_moe = (e * (routed * 64 + routed * 3 * 128)  # fc1 in / out, fc2 in (no [T k, h] out:
                # the probabilities multiply the activation inside the experts)
                + 5 * tokens * 4 + 12 * tokens * 2  # probs fp32 + bool map; top-k ids, scores
                + 12 * routed)  # the receive side's sort indices, permuted probabilities
    want_dense_mlp = e * tokens * 3 * 128  # swiglu input (2f) and fc2 input (f)
    got = float(moe.activation_bytes[0] - dense.activation_bytes[0])
    assert got == pytest.approx(want_moe - want_dense_mlp, rel=1e-12)


def test_all_to_all_bytes_and_placement_by_hand() -> None:
    """Dispatch + combine each way: 4 all-to-alls of rho*T*k*(h*2 + 4) bytes per rank. Inside a
    node (q = p) an all-to-all moves (p-1)/p of it over NVLink; across nodes the inter-node
    share runs at the network bandwidth x all_to_all_inter_efficiency for that node count."""
    cluster = _cluster(8, nodes=2)
    cm = CostModel(TINY, cluster, TrainingSpec(global_batch_size=8, seq_length=256))
    n = np.array([1e6, 1e6])
    inside = M.ep_all_to_all_s(cm, n, np.array([8, 4]), np.array([1, 2]))
    assert inside == pytest.approx([7 / 8 * 1e6 / 100e9, 3 / 4 * 1e6 / 100e9], rel=1e-12)
    across = M.ep_all_to_all_s(cm, n[:1], np.array([16]), np.array([1]))
    eff = cluster.all_to_all_inter_efficiency[0]  # 2 nodes
    want = max(7 / 16 * 1e6 / 100e9, 8 / 16 * 1e6 / (10e9 * eff))
    assert across == pytest.approx([want], rel=1e-12)
    # The layer's expert communication at ep=2 on one node, all link latencies 0: 4 all-to-alls
    # of rho*T*k*(2h + 4) bytes, plus the all-gather of the [E] int64 counts (8 E ep bytes over
    # the ep ranks) once each way, which NCCL runs under its LL protocol (a third of the bus
    # bandwidth inside a node, plus its base latency: cost/comm.py).
    from megatron_ext.planner.cost.comm import BASE_LATENCY_S

    rho = DEFAULT_MOE_IMBALANCE
    _, _, c2 = _moe_costs(LayerStrategy(dp=4, ep=2))
    _, _, c1 = _moe_costs(LayerStrategy(dp=4))
    bytes_a2a = rho * 256 * 2 * (64 * 2 + 4)
    gather = BASE_LATENCY_S["ring"][0] + 1 / 2 * 8 * 4 * 2 / (100e9 / 3)
    comm = 4 * (1 / 2 * bytes_a2a / 100e9) + 2 * gather
    assert float(c2.comm_s[0] - c1.comm_s[0]) == pytest.approx(comm, rel=1e-9)


def test_imbalance_scales_expert_work_and_capacity_caps_it() -> None:
    base = TrainingSpec(global_batch_size=8, seq_length=256, moe_imbalance=1.0)
    _, _, c1 = _moe_costs(LayerStrategy(dp=4, ep=2), training=base)
    _, _, c2 = _moe_costs(LayerStrategy(dp=4, ep=2),
                          training=dataclasses.replace(base, moe_imbalance=2.0))
    assert float(c2.forward_s[0]) > float(c1.forward_s[0])
    assert float(c2.activation_bytes[0]) > float(c1.activation_bytes[0])
    capped = dataclasses.replace(TINY, moe=dataclasses.replace(TINY.moe, capacity_factor=1.0))
    assert M.imbalance(capped, 2.0) == 1.0 and M.imbalance(TINY, 2.0) == 2.0


def test_kind_dp_equals_enumeration() -> None:
    """layer_dp with [K, S] costs and a kind per position against all assignments."""
    rng = np.random.default_rng(3)
    for _ in range(60):
        num, n = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        cost = rng.uniform(0.1, 2.0, (2, num))
        cost[1, rng.random(num) < 0.3] = np.inf  # strategies one kind may not use
        mem = rng.integers(0, 6, (2, num))
        switch = rng.uniform(0.0, 0.5, (num, num))
        np.fill_diagonal(switch, 0.0)
        kinds = rng.integers(0, 2, n)
        budget = int(rng.integers(0, 16))
        dp = layer_dp(cost, mem, switch, num_layers=n, budget_units=budget, kinds=kinds,
                      keep_choices=True)
        for length in range(1, n + 1):
            want = np.inf
            for picks in itertools.product(range(num), repeat=length):
                if sum(mem[kinds[i], s] for i, s in enumerate(picks)) <= budget:
                    want = min(want, sum(cost[kinds[i], s] for i, s in enumerate(picks))
                               + sum(switch[a, b] for a, b in itertools.pairwise(picks)))
            assert dp.best[length, budget] == pytest.approx(want, rel=1e-12)
        if np.isfinite(dp.best[n, budget]):
            picks = dp.picks(n, budget)
            assert sum(mem[kinds[i], s] for i, s in enumerate(picks)) <= budget


def test_start_aware_partition_equals_enumeration() -> None:
    rng = np.random.default_rng(4)
    for _ in range(100):
        pp, num_layers = int(rng.integers(1, 4)), int(rng.integers(3, 8))
        m = int(rng.integers(1, 6))
        slot = rng.uniform(0.5, 3.0, (pp, num_layers + 1, num_layers + 1)).cumsum(axis=2)
        slot[rng.random(slot.shape) < 0.1] = np.inf
        want = np.inf
        for cuts in itertools.combinations(range(1, num_layers), pp - 1):
            bounds = (0, *cuts, num_layers)
            counts = [b - a for a, b in itertools.pairwise(bounds)]
            want = min(want, partition_objective(slot, counts, m))
        got = best_partition(slot, num_layers, m)
        if not np.isfinite(want):
            assert got is None
            continue
        assert got is not None and got[0] == pytest.approx(want, rel=1e-12)


# Wide experts: 16 experts of 2048 x 8192 x 3 params (0.8 B per MoE layer, 10.9 GB of weights,
# gradients and ZeRO-1 states per layer replicated at tp=1): splitting them is the obvious move.
BIG_EXPERTS = ModelSpec(name="wide-moe", num_layers=4, hidden_size=2048, ffn_hidden_size=8192,
                        num_attention_heads=16, num_query_groups=16, vocab_size=32000,
                        max_position_embeddings=1024,
                        moe=MoESpec(num_experts=16, router_topk=2, layer_freq=(0, 1, 0, 1)))


def _wide_cm(memory_gib: float) -> CostModel:
    cluster = ClusterSpec(name="dgx-h100", num_nodes=1, gpus_per_node=8, memory_gib=memory_gib)
    return CostModel(BIG_EXPERTS, cluster, TrainingSpec(global_batch_size=16, seq_length=1024))


def test_search_picks_expert_parallelism_when_experts_do_not_fit_replicated() -> None:
    cm = _wide_cm(24.0)
    result = search(cm, options=SearchOptions(explain_infeasible=False))
    plan = result.plan
    moe = [s for i, s in enumerate(plan.layers) if BIG_EXPERTS.is_moe_layer(i)]
    dense = [s for i, s in enumerate(plan.layers) if not BIG_EXPERTS.is_moe_layer(i)]
    assert all(s.ep * s.expert_tp > 1 for s in moe), [s.describe() for s in moe]
    assert all(s.ep == 1 and s.etp is None for s in dense)
    assert set(moe).isdisjoint(dense)  # dense and MoE layers on different strategies
    # what the layerwise runtime runs for MoE models: ZeRO 0/1 on MoE layers, vocabulary tp
    assert all(s.zero <= 1 for s in moe) and plan.vocab.mode == "tp"
    # ... and the same plan without expert parallelism is slower or does not fit
    plain = tuple(dataclasses.replace(x, ep=1, etp=None) for x in plan.layers)
    without = evaluate(cm, dataclasses.replace(plan.layout, layers=plain))
    assert not without.feasible or without.iteration_s > result.evaluation.iteration_s
    assert result.evaluation.feasible
    assert result.evaluation.iteration_s <= result.uniform_evaluation.iteration_s + 1e-12


def test_uniform_moe_baseline_is_one_megatron_layout() -> None:
    cm = _wide_cm(40.0)
    found = search_uniform(cm)
    assert found is not None
    layout, ev = found
    moe = {s for i, s in enumerate(layout.layers) if BIG_EXPERTS.is_moe_layer(i)}
    dense = {s for i, s in enumerate(layout.layers) if not BIG_EXPERTS.is_moe_layer(i)}
    assert len(moe) == 1 and len(dense) == 1  # one --expert-model/tensor-parallel-size
    (m,), (d,) = moe, dense
    assert dataclasses.replace(m, ep=1, etp=None) == d  # same TP/CP/DP/ZeRO/recompute
    assert BIG_EXPERTS.moe.num_experts % m.ep == 0 and m.width % (m.ep * m.expert_tp) == 0
    assert m.tp == 1 or m.sp
    again = evaluate(cm, layout)
    assert again.iteration_s == pytest.approx(ev.iteration_s, rel=1e-12)


def test_stages_are_priced_by_their_layer_kinds() -> None:
    """evaluate prices each layer as its kind: with the two MoE layers on stage 0 and two dense
    layers on stage 1 (layer_freq 1,1,0,0), stage 0 is the busier one, by the per-layer rows."""
    model = dataclasses.replace(BIG_EXPERTS, moe=dataclasses.replace(BIG_EXPERTS.moe,
                                                                     layer_freq=(1, 1, 0, 0)))
    # 4 samples per replica and micro-batch: compute-bound, above the host floor of a pass
    cm = CostModel(model, ClusterSpec(name="dgx-h100", num_nodes=1, gpus_per_node=8),
                   TrainingSpec(global_batch_size=64, seq_length=1024))
    s = LayerStrategy(tp=1, dp=4, zero=1)
    moe_s = dataclasses.replace(s, ep=4)
    layers = (moe_s, moe_s, s, s)
    ev = evaluate(cm, PlanLayout(pp=2, stages=((0, 2), (2, 4)), layers=layers,
                  vocab=VocabStrategy(mode="tp", tp=1), micro_batch_size=16))
    rows = M.per_layer_costs(cm, StrategyTable.of([s, moe_s]), 16, np.array([1, 1, 0, 0]))
    assert rows.forward_s[0] > 1.5 * rows.forward_s[2]  # top-2 of 8192-wide experts vs 8192 MLP
    assert ev.stage_busy_s[0] > ev.stage_busy_s[1]
    # the search's partition sees the same: slot of stage 0 with the 2 MoE layers is dearer
    m = 64 // 16
    work = [m * float((rows.forward_s[a:b] + rows.backward_s[a:b]).sum()) for a, b in
            ((0, 2), (2, 4))]
    assert work[0] > work[1]


def test_space_offers_expert_layouts_to_moe_layers_only() -> None:
    training = TrainingSpec(global_batch_size=8, seq_length=256)
    table = layer_strategies(TINY, training, width=4, nvlink_gpus=4, micro_batch_size=4)
    valid = M.valid_for(TINY, table)
    pairs = {(s.tp, s.ep, s.etp) for s in table.strategies if s.has_expert_dims}
    assert {(1, 2, None), (1, 4, None), (2, 2, None), (2, 2, 1), (4, 1, 1)} - pairs == {(4, 1, 1)}
    assert all(s.ep in (1, 2, 4) and (s.etp in (None, 1)) for s in table.strategies)
    dense_ok = [s for s, ok in zip(table.strategies, valid[0]) if ok]
    assert dense_ok and all(not s.has_expert_dims for s in dense_ok)
    moe_ok = [s for s, ok in zip(table.strategies, valid[1]) if ok]
    assert all(s.tp == 1 or s.sp for s in moe_ok)  # MoE with TP needs SP
    assert not any(s.ep == 1 and s.expert_tp != s.tp for s in moe_ok)
    assert all(s.zero <= 1 for s in moe_ok)  # the runtime refuses ZeRO-2/3 on MoE layers


def test_cli_moe_imbalance(tmp_path, capsys) -> None:
    from megatron_ext.cli import main

    argv = ["search", "--model", "tiny-moe", "--cluster", "dgx-h100", "--global-batch-size", "8",
            "--seq-length", "256"]
    assert main([*argv, "--moe-imbalance", "0.5"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("must be >= 1 (busiest rank's routed tokens over the mean; "
                            "1 = balanced)"), err
    assert main([*argv, "--moe-imbalance", "1.5", "--out", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().err
    assert "active per token" in out
    assert main(["evaluate", str(tmp_path / "p.json"), "--moe-imbalance", "1.5"]) == 0
    out = capsys.readouterr().err
    assert "model: 0.00B parameters, 0.00B active per token (MFU counts the active ones)" in out


def test_infeasibility_bound_counts_the_experts() -> None:
    """Mixtral-8x7B (46.7B parameters, 16 bytes each with Adam) cannot fit 8 x 80 GiB even fully
    sharded; priced as the 7.2B dense model of its shape it would seem to fit easily."""
    from megatron_ext.planner.infeasible import min_allocated_bytes

    model = MODEL_PRESETS["mixtral-8x7b"]
    cluster = ClusterSpec(name="dgx-h100", num_nodes=1, gpus_per_node=8)
    training = TrainingSpec(global_batch_size=8, seq_length=4096)
    moe = min_allocated_bytes(CostModel(model, cluster, training))
    dense = min_allocated_bytes(CostModel(dataclasses.replace(model, moe=None), cluster, training))
    assert moe > 46.7e9 * 16 / 8 > 80 * 2**30 > dense


def test_uniform_moe_baseline_gives_exact_megatron_flags() -> None:
    """The baseline the search compares against is a layout stock Megatron-LM runs: its plan
    prints plain flags (no --strategy-config) with the expert degrees, and reading them back
    gives the same plan."""
    from megatron_ext.flags.emit import plan_to_megatron_args
    from megatron_ext.flags.parser import parse_megatron_args
    from megatron_ext.flags.to_plan import plan_from_megatron_args
    from megatron_ext.planner.search import layout_to_plan

    cm = _wide_cm(40.0)
    layout, ev = search_uniform(cm)
    plan = layout_to_plan(cm, layout, ev)
    args = plan_to_megatron_args(plan)
    assert not args.uses_strategy_config, args.needs_megatron_ext
    argv = list(args.argv)
    moe = next(s for i, s in enumerate(plan.layers) if BIG_EXPERTS.is_moe_layer(i))
    assert argv[argv.index("--expert-model-parallel-size") + 1] == str(moe.ep)
    again = plan_from_megatron_args(parse_megatron_args(argv, world_size=8), 8)
    assert (again.layers, again.stages, again.virtual_stages, again.micro_batch_size) == (
        plan.layers, plan.stages, plan.virtual_stages, plan.micro_batch_size)
