"""Cost-model terms: each formula against its closed form, and the vectorised paths against the
exact evaluator. Expected values are computed independently from the papers' formulas."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_ext.plan import LayerStrategy, PlanLayout, VocabStrategy
from megatron_ext.planner.cost.comm import AlphaBetaComm, GroupLayout, group_layout
from megatron_ext.planner.cost.evaluate import evaluate
from megatron_ext.planner.cost.memory import (
    layer_activation_bytes,
    state_bytes_per_param,
)
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.cost.pipeline import one_f_one_b
from megatron_ext.planner.space import StrategyTable
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.planner.uniform import score_uniform
from megatron_ext.presets import cluster_preset, model_preset


def test_activation_bytes_match_korthikanti():
    """GPT-3 shape (f = 4h, no GQA), no flash attention, dropout on, bf16: eq. 2 of Korthikanti
    et al.: sbh(10 + 24/t + 5as/(ht)) without SP, sbh(34/t + 5as/(ht)) with SP, 2sbh(/t) full."""
    model = model_preset("gpt3-13b")
    s, b, h, a = 2048, 2, model.hidden_size, model.num_attention_heads
    for t in (1, 2, 4, 8):
        kw = {
            "b": b,
            "seq_length": s,
            "tp": t,
            "cp": 1,
            "ulysses": 1,
            "element_bytes": 2,
            "flash_attention": False,
            "dropout": True,
        }
        plain = layer_activation_bytes(model, sp=False, recompute=0, **kw)
        assert plain == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
        if t > 1:
            sp = layer_activation_bytes(model, sp=True, recompute=0, **kw)
            assert sp == pytest.approx(s * b * h * (34 / t + 5 * a * s / (h * t)))
            full = layer_activation_bytes(model, sp=True, recompute=2, **kw)
            assert full == pytest.approx(2 * s * b * h / t)
        selective = layer_activation_bytes(model, sp=False, recompute=1, **kw)
        assert selective == pytest.approx(s * b * h * (10 + 24 / t))
    # Context parallelism and Ulysses split every term by their degree.
    base = layer_activation_bytes(
        model, b=b, seq_length=s, tp=2, sp=True, cp=1, ulysses=1, recompute=0, element_bytes=2
    )
    split = layer_activation_bytes(
        model, b=b, seq_length=s, tp=2, sp=True, cp=2, ulysses=2, recompute=0, element_bytes=2
    )
    assert split == pytest.approx(base / 4)


def test_state_bytes_per_zero_level():
    """Mixed precision Adam: 2 + 4 + 4 + 8 = 18 B/param; ZeRO-1 shards 12; ZeRO-3 (FSDP2, fp32
    shards are the master) shards 4 + 4 + 8."""
    assert state_bytes_per_param(0, 8, half_precision=True) == 18
    assert state_bytes_per_param(1, 8, half_precision=True) == pytest.approx(6 + 12 / 8)
    assert state_bytes_per_param(3, 8, half_precision=True) == pytest.approx(16 / 8)
    assert state_bytes_per_param(3, 4, half_precision=False) == pytest.approx(16 / 4)
    assert state_bytes_per_param(0, 4, half_precision=False) == 16
    assert state_bytes_per_param(1, 4, half_precision=False) == pytest.approx(8 + 8 / 4)
    # ZeRO-2: the ZeRO-3 shards plus the weights gathered between forward and backward.
    assert state_bytes_per_param(2, 8, half_precision=True) == pytest.approx(2 + 16 / 8)
    assert state_bytes_per_param(2, 4, half_precision=False) == pytest.approx(4 + 16 / 4)
    levels = [state_bytes_per_param(z, 8, half_precision=True) for z in (0, 1, 2, 3)]
    assert levels == sorted(levels, reverse=True)


def test_collectives_follow_nccls_algorithm_and_protocol_model():
    """Large messages inside a node: the Simple ring, base latency + 2(p-1) NVLink hops +
    2(p-1)/p N / busbw; small ones take a low-latency protocol (cheaper than the Simple ring);
    across nodes the bus bandwidth is the members' NICs in parallel, and a tree can win the
    all-reduce at mid sizes; the curve's bus bandwidth rises with the message size."""
    from megatron_ext.planner.cost.comm import BASE_LATENCY_S

    cluster = cluster_preset("dgx-h100", num_nodes=4)
    comm = AlphaBetaComm(cluster=cluster)
    intra, inter = cluster.intra_node, cluster.inter_node
    n = 1e9
    inside = group_layout(8, 1, 8)
    assert not inside.crosses_nodes
    ring = BASE_LATENCY_S["ring"][2] + 2 * 7 * intra.latency_s
    want = ring + 2 * 7 / 8 * n / intra.bandwidth_bytes_per_s
    assert comm.time_s("all_reduce", n, inside) == pytest.approx(want)
    gather = BASE_LATENCY_S["ring"][2] + 7 * intra.latency_s
    gather += 7 / 8 * n / intra.bandwidth_bytes_per_s
    assert comm.time_s("all_gather", n, inside) == pytest.approx(gather)
    small = 64e3
    simple = comm.ring_s("all_reduce", small, inside, 2)
    assert comm.time_s("all_reduce", small, inside) < 0.7 * simple
    busbw = [2 * 7 / 8 * s / comm.time_s("all_reduce", s, inside) for s in (1e6, 3e7, 1e9)]
    assert busbw == sorted(busbw) and busbw[-1] < intra.bandwidth_bytes_per_s
    # A dp group of 4 ranks, one per node (stride 8): one NIC each, at most the ring over it.
    across = group_layout(4, 8, 8)
    assert across.crosses_nodes and across.ranks_per_node == 1
    slowest = comm.ring_s("all_reduce", n, across, 2)
    assert comm.time_s("all_reduce", n, across) <= slowest
    assert slowest > 2 * 3 / 4 * n / inter.bandwidth_bytes_per_s
    # 32 ranks over 4 nodes drive 8 NICs per node in parallel.
    assert comm.bus_bandwidth_bytes_per_s(group_layout(32, 1, 8)) == pytest.approx(
        min(intra.bandwidth_bytes_per_s, 8 * inter.bandwidth_bytes_per_s)
    )
    wide = group_layout(32, 1, 8)
    mid = 2e6
    assert comm.time_s("all_reduce", mid, wide) == pytest.approx(min(
        [comm.ring_s("all_reduce", mid, wide, k) for k in range(3)]
        + [comm.tree_s(mid, wide, k) for k in range(3)]))
    assert comm.time_s("all_reduce", n, GroupLayout(size=1, ranks_per_node=1)) == 0


def measured_profile(overlap_slowdown: float = 1.3):
    """A hardware-profiler ClusterProfile of one dgx-h100 node with one measured curve."""
    from megatron_ext.planner.profile.profiles import ClusterProfile, CollectiveCurve

    curve = CollectiveCurve(
        collective="all_reduce",
        group_size=8,
        stride=1,
        ranks_per_node=8,
        num_bytes=(1e6, 1e7, 1e8),
        seconds=(1e-4, 1e-3, 1e-2),
    )
    return ClusterProfile(
        cluster=cluster_preset("dgx-h100"),
        backend="nccl",
        device="test",
        overlap_slowdown=overlap_slowdown,
        collectives=(curve,),
    )


def test_cluster_profile_replaces_the_formulas_where_measured():
    """The profiler's ClusterProfile is a CommModel: measured curves where they exist (10x slower
    than the preset's NVLink here), the formula elsewhere, and its measured overlap slowdown."""
    profile = measured_profile()
    training = TrainingSpec(global_batch_size=64, seq_length=2048)
    model = model_preset("llama2-7b")
    measured = CostModel(model, profile.cluster, training, comm=profile)
    analytic = CostModel(model, profile.cluster, training)
    assert measured.overlap_slowdown == 1.3 and analytic.overlap_slowdown == 1.1
    layout = group_layout(8, 1, 8)
    assert measured.comm.time_s("all_reduce", 1e7, layout) == pytest.approx(1e-3, rel=1e-6)
    table = StrategyTable.of([LayerStrategy(tp=8, dp=1, zero=1), LayerStrategy(tp=1, dp=8)])
    slow, fast = measured.layer_costs(table, 8), analytic.layer_costs(table, 8)
    assert slow.comm_s[0] > 2 * fast.comm_s[0]  # TP all-reduces over 8 ranks are measured
    assert slow.grad_sync_s[1] > 2 * fast.grad_sync_s[1]  # so is the 8-rank DP all-reduce


def test_one_f_one_b_equal_stages_is_textbook():
    """Equal stages, no tails: (m + p - 1) * (f + b)."""
    for pp, m in [(1, 8), (4, 8), (4, 2), (8, 32)]:
        f, b = np.full(pp, 0.3), np.full(pp, 0.6)
        zero = np.zeros(pp)
        pipe = one_f_one_b(f, b, zero, zero, zero, zero, m)
        assert pipe.iteration_s == pytest.approx((m + pp - 1) * 0.9)


def test_one_f_one_b_interleaved_equal_stages():
    """Megatron's interleaved schedule with v chunks per stage: fill and drain shrink to
    (p - 1) / v slots, (m + (p - 1) / v) * (f + b) for equal stages and free messages."""
    for pp, m, v in [(4, 8, 2), (8, 32, 3), (2, 4, 4)]:
        f, b = np.full(pp, 0.3), np.full(pp, 0.6)
        zero = np.zeros(pp)
        pipe = one_f_one_b(f, b, zero, zero, zero, zero, m, virtual_stages=v)
        assert pipe.iteration_s == pytest.approx((m + (pp - 1) / v) * 0.9)
        plain = one_f_one_b(f, b, zero, zero, zero, zero, m)
        assert pipe.iteration_s < plain.iteration_s


def test_zero3_traffic_crosses_nodes_at_one_nic_per_gpu():
    """ZeRO-3's per-layer collectives over a group of 8 GPUs per node on 4 nodes run at one
    NIC's bandwidth (SC'21 Table 2), ZeRO-1's once-per-step ones at the 8-NIC aggregate."""
    cluster = cluster_preset("dgx-a100-80g", num_nodes=4)
    cm = CostModel(model_preset("gpt3-13b"), cluster,
                   TrainingSpec(global_batch_size=32, seq_length=2048, allow_zero3=True))
    num_bytes = np.array([1e9])
    aggregate = cm.collective_s("all_gather", num_bytes, np.array([32]), np.array([1]))
    one_nic = cm.collective_s("all_gather", num_bytes, np.array([32]), np.array([1]),
                              nics_per_gpu=1.0)
    # 8 NICs x 22 GB/s vs 1 x 22 GB/s for (p-1)/p of the buffer, plus the same latency
    assert float(one_nic[0] - aggregate[0]) == pytest.approx(
        31 / 32 * 1e9 * (1 / 22e9 - 1 / (8 * 22e9)), rel=1e-9)
    table = StrategyTable.of([LayerStrategy(dp=32, zero=3), LayerStrategy(dp=32, zero=1)])
    costs = cm.layer_costs(table, 32)
    assert costs.comm_s[0] > 0 and costs.comm_s[1] == 0  # ZeRO-3 pays every micro-batch


def _cost_model(memory_gib=80.0):
    training = TrainingSpec(global_batch_size=64, seq_length=2048)
    cluster = cluster_preset("dgx-h100", num_nodes=2, memory_gib=memory_gib)
    return CostModel(model_preset("llama2-7b"), cluster, training)


def test_costs_move_the_right_way():
    cm = _cost_model()
    table = StrategyTable.of(
        [
            LayerStrategy(tp=2, sp=True, dp=4, zero=1),
            LayerStrategy(tp=2, sp=True, dp=4, zero=1, recompute="full"),
            LayerStrategy(tp=2, sp=True, dp=4, zero=3),
            LayerStrategy(tp=8, sp=True, dp=1, zero=1),
        ]
    )
    c = cm.layer_costs(table, 8)
    assert c.activation_bytes[1] < c.activation_bytes[0] and c.backward_s[1] > c.backward_s[0]
    assert c.recompute_s[1] > 0 and c.recompute_s[0] == 0
    assert c.state_bytes[2] < c.state_bytes[0] and c.forward_s[2] >= c.forward_s[0]
    assert c.state_bytes[3] < c.state_bytes[0]


def test_sequence_parallel_moves_the_same_tp_bytes():
    """Megatron SP replaces each all-reduce by an all-gather + reduce-scatter: the same volume
    and hops, but two collectives, so one more NCCL base latency (8.4 us, Simple ring) each."""
    from megatron_ext.planner.cost.comm import BASE_LATENCY_S

    cm = _cost_model()
    table = StrategyTable.of(
        [LayerStrategy(tp=4, sp=True, dp=2, zero=1), LayerStrategy(tp=4, sp=False, dp=2, zero=1)]
    )
    c = cm.layer_costs(table, 8)
    # 2 blocks x (forward + backward) collectives, each one base latency more with SP
    assert c.comm_s[0] - c.comm_s[1] == pytest.approx(4 * BASE_LATENCY_S["ring"][2])
    assert c.activation_bytes[0] < c.activation_bytes[1]


def test_uniform_vectorised_score_equals_evaluate():
    cm = _cost_model()
    for pp, mbs in [(1, 16), (2, 8), (4, 4)]:
        found = score_uniform(cm, pp, mbs)
        assert found is not None
        layout = found[1]
        ev = evaluate(
            cm,
            PlanLayout(pp=pp,
            stages=layout.stages,
            layers=layout.layers,
            vocab=layout.vocab,
            micro_batch_size=mbs,
            virtual_stages=layout.virtual_stages),  # the best may be interleaved
        )
        assert ev.feasible
        assert ev.iteration_s == pytest.approx(found[0], rel=1e-12)


def test_vocabulary_parallel_balances_the_last_stage():
    """With a 128k vocabulary the last stage carries the output layer under mode tp; vocabulary
    parallelism spreads it so the stages' busy times even out. (Memory need not drop: every stage
    keeps one more micro-batch in flight, as the paper's Table 5 shows for small vocabularies.)"""
    training = TrainingSpec(global_batch_size=64, seq_length=4096)
    cm = CostModel(model_preset("llama3-8b"), cluster_preset("dgx-h100", num_nodes=1), training)
    layers = [LayerStrategy(tp=1, dp=2, zero=1)] * 32
    stages = [(8 * k, 8 * k + 8) for k in range(4)]
    tp_mode = evaluate(
        cm, PlanLayout(pp=4, stages=stages, layers=layers, vocab=VocabStrategy(tp=1),
                       micro_batch_size=2)
    )
    vp_mode = evaluate(
        cm,
        PlanLayout(pp=4,
        stages=stages,
        layers=layers,
        vocab=VocabStrategy(mode="vocab_parallel", tp=1),
        micro_batch_size=2),
    )
    spread = lambda ev: max(ev.stage_busy_s) / min(ev.stage_busy_s)
    assert spread(vp_mode) < spread(tp_mode)
    assert vp_mode.iteration_s < tp_mode.iteration_s


def test_memory_cap_excludes_the_reserve():
    cm = _cost_model(memory_gib=40.0)
    assert cm.memory_cap_bytes == pytest.approx((40 - (1 + 0.04 * 40)) * 2**30)
    fixed = dataclasses.replace(cm.training, reserve_gib=2.0)
    assert CostModel(cm.model, cm.cluster, fixed).memory_cap_bytes == pytest.approx(38 * 2**30)


def test_interleaved_inflight_matches_megatron_warmup():
    """In-flight chunk micro-batches of the interleaved schedule: with one chunk 1F1B's p - k
    (at most m); with v chunks the first stage holds p v + p - 1 chunk micro-batches at its
    peak (Narayanan et al. 2021: p (1 + (p - 1) / (p v)) stages' worth) and the last (v-1) p + 1,
    megatron-core's warm-up 2 (p - k - 1) + (v - 1) p plus the first steady forward."""
    from megatron_ext.planner.cost.pipeline import interleaved_inflight
    from megatron_ext.planner.cost.vocab import inflight_microbatches

    for pp, m in [(4, 8), (4, 2), (2, 6)]:
        peak = interleaved_inflight(pp, m, 1)[..., 0].max(axis=0)
        assert list(peak) == list(inflight_microbatches(pp, m, VocabStrategy()))
    for pp, m, v in [(4, 8, 2), (4, 16, 3), (2, 4, 4)]:
        units = interleaved_inflight(pp, m, v).sum(axis=-1).max(axis=0)
        assert units[0] == pp * v + pp - 1
        assert units[-1] == (v - 1) * pp + 1
        assert list(units) == [min(2 * (pp - k - 1) + (v - 1) * pp + 1, m * v)
                               for k in range(pp)]


def test_interleaved_evaluation_trades_bubble_for_memory_and_messages():
    """The same layers as pp=4 stages of 8 or as 2 chunks of 4 per stage: the interleaved
    schedule has the smaller bubble, twice the point-to-point time, more activation memory on
    the first stage (p v + p - 1 = 11 chunk micro-batches of 4 layers vs 4 of 8 layers), and
    equal weights."""
    cluster = cluster_preset("dgx-a100-80g", num_nodes=1)
    cm = CostModel(model_preset("gpt3-6.7b"), cluster,
                   TrainingSpec(global_batch_size=16, seq_length=2048))
    s = LayerStrategy(tp=2, sp=True, dp=1)
    kw = {"pp": 4, "layers": (s,) * 32, "vocab": VocabStrategy(tp=2), "micro_batch_size": 1}
    plain = evaluate(cm, PlanLayout(stages=tuple((8 * k, 8 * k + 8) for k in range(4)), **kw))
    chunks = tuple((4 * j, 4 * j + 4) for j in range(8))
    inter = evaluate(cm, PlanLayout(stages=chunks, virtual_stages=2, **kw))
    assert inter.breakdown["pipeline_bubble_s"] < plain.breakdown["pipeline_bubble_s"]
    assert inter.breakdown["p2p_s"] == pytest.approx(2 * plain.breakdown["p2p_s"])
    costs = cm.layer_costs(StrategyTable.of([s]), 1)
    act = float(costs.activation_bytes[0])
    # first stage: activations of 11 chunk micro-batches of 4 layers instead of 4 x 8 layers
    extra = (11 * 4 - 4 * 8) * act
    from megatron_ext.planner.cost.vocab import stage_extras

    # the embedding's dropout mask follows chunk 0's in-flight micro-batches (8 instead of 4)
    ex1 = stage_extras(cm, VocabStrategy(tp=2), 4, 1, 16, 0)
    ex2 = stage_extras(cm, VocabStrategy(tp=2), 4, 1, 16, 0, virtual_stages=2)
    vocab_extra = float(ex2.fixed_bytes[0] - ex1.fixed_bytes[0])
    assert inter.stage_peak_bytes[0] - plain.stage_peak_bytes[0] == pytest.approx(
        extra + vocab_extra)


def test_overlapped_p2p_costs_what_outlasts_the_chunk_forward():
    """Megatron's interleaved schedule with overlap_p2p_comm (TrainingSpec.overlap_p2p_comm):
    each message costs max(0, c - f_k / v) instead of c; without virtual stages the setting
    changes nothing (Megatron-LM turns it off there). Pipeline stages across nodes (one 8-GPU
    node per stage) make the messages large enough to matter; rel 1e-12: the same sums."""
    from megatron_ext.planner.cost.evaluate import overlapped_p2p_s, stage_sums

    cluster = cluster_preset("dgx-a100-80g", num_nodes=4)
    model = model_preset("gpt3-6.7b")
    s = LayerStrategy(tp=8, sp=True, dp=1)
    kw = {"pp": 4, "layers": (s,) * 32, "vocab": VocabStrategy(tp=8), "micro_batch_size": 1}
    chunks = PlanLayout(stages=tuple((4 * j, 4 * j + 4) for j in range(8)), virtual_stages=2,
                        **kw)
    plain = PlanLayout(stages=tuple((8 * k, 8 * k + 8) for k in range(4)), **kw)

    def cm(overlap: bool) -> CostModel:
        return CostModel(model, cluster, TrainingSpec(global_batch_size=16, seq_length=2048,
                                                      overlap_p2p_comm=overlap))

    waited, overlapped = evaluate(cm(False), chunks), evaluate(cm(True), chunks)
    sums = stage_sums(cm(False), chunks)
    c, f = sums.extras.p2p_s, sums.arr["f"]
    assert float(c[0]) > 0 and float(f[0]) > 0
    exposed = overlapped_p2p_s(c, f, 2)
    assert list(exposed) == [max(0.0, float(ck - fk / 2)) for ck, fk in zip(c, f)]
    m = 16
    assert overlapped.breakdown["p2p_s"] == pytest.approx(2 * 2 * m * float(exposed[0]),
                                                          rel=1e-12)
    assert overlapped.iteration_s < waited.iteration_s
    assert waited.breakdown["p2p_s"] == pytest.approx(2 * 2 * m * float(c[0]), rel=1e-12)
    assert evaluate(cm(True), plain).iteration_s == evaluate(cm(False), plain).iteration_s


def test_uniform_baseline_considers_interleaving():
    """With many micro-batches per stage the bubble is small; with few it dominates and the
    uniform baseline picks Megatron's interleaved schedule, scored exactly as `evaluate`."""
    from megatron_ext.planner.uniform import search_uniform

    cm = CostModel(model_preset("llama2-7b"),
                   cluster_preset("dgx-a100-80g", num_nodes=1, memory_gib=24),
                   TrainingSpec(global_batch_size=64, seq_length=2048))
    layout, ev = search_uniform(cm)
    assert layout.virtual_stages > 1 and layout.pp > 1
    off = dataclasses.replace(cm.training, allow_interleaving=False)
    layout_off, ev_off = search_uniform(CostModel(cm.model, cm.cluster, off))
    assert layout_off.virtual_stages == 1
    assert ev.iteration_s < ev_off.iteration_s
    again = evaluate(cm, layout)
    assert again.iteration_s == pytest.approx(ev.iteration_s, rel=1e-12)


def _tp_overlap_cms(tp_comm_overlap: bool, cluster: str = "dgx-h100") -> CostModel:
    return CostModel(model_preset("llama2-13b"), cluster_preset(cluster, num_nodes=2),
                     TrainingSpec(global_batch_size=64, seq_length=4096, precision="bf16",
                                  tp_comm_overlap=tp_comm_overlap))


@pytest.mark.parametrize("cluster", ["dgx-h100", "dgx-a100-80g"])
def test_tp_comm_overlap_hides_at_most_the_tp_collectives(cluster):
    """--tp-comm-overlap: a layer with tp > 1 and sp saves no more than its four SP collectives
    per pass (the host floor's soft maximum has slope <= 1); at tp = 1 nothing changes, bit for
    bit. On H100 it saves at every tp > 1; on A100 at tp = 2 the 16 SMs the pipelined and bulk
    overlaps take from their GEMMs (14.8% of 108) cost more than the short NVLink collectives
    they hide, so the saving there may be negative, never above the collectives."""
    table = StrategyTable.of([
        LayerStrategy(tp=t, sp=t > 1, dp=16 // t, recompute=r)
        for t in (1, 2, 4, 8) for r in ("none", "full")])
    off = _tp_overlap_cms(False, cluster).layer_costs(table, 16)
    on = _tp_overlap_cms(True, cluster).layer_costs(table, 16)
    cm = _tp_overlap_cms(False, cluster)
    rows = 16 / table.dp * 4096
    one_way = 4 * cm.collective_s("all_gather", rows * cm.model.hidden_size * 2, table.tp, 1)
    passes = 2 + (table.recompute == 2)  # forward, backward, recomputed forward
    saved = (off.forward_s + off.backward_s) - (on.forward_s + on.backward_s)
    tp1 = table.tp == 1
    assert np.array_equal(on.forward_s[tp1], off.forward_s[tp1])
    assert np.array_equal(on.backward_s[tp1], off.backward_s[tp1])
    assert np.all(saved <= passes * one_way * (1 + 1e-12))
    if cluster == "dgx-h100":
        assert np.all(saved[~tp1] > 0)
    else:
        assert np.all(saved[table.tp >= 4] > 0)
    # the saving is the exposed communication's (less what the host floor absorbs: within 1%)
    assert np.allclose(off.comm_s - on.comm_s, saved, rtol=1e-2, atol=0)


def test_tp_comm_overlap_iteration_time():
    """A whole plan (pp 1: no bubble): faster with the overlap by at most its TP collectives
    over all micro-batches and layers; the same layout at tp = 1 is priced identically."""
    cm_off, cm_on = _tp_overlap_cms(False), _tp_overlap_cms(True)
    layers = cm_off.model.num_layers
    for tp in (1, 8):
        layout = PlanLayout(pp=1, stages=((0, layers),), layers=(
            LayerStrategy(tp=tp, sp=tp > 1, dp=16 // tp, recompute="full"),) * layers,
            micro_batch_size=16 // tp, vocab=VocabStrategy(tp=tp))
        off, on = evaluate(cm_off, layout).iteration_s, evaluate(cm_on, layout).iteration_s
        if tp == 1:
            assert on == off
            continue
        m = 64 // layout.micro_batch_size
        collective = cm_off.collective_s("all_gather", np.array([4096.0 * 5120 * 2]), tp, 1)
        tp_comm = m * layers * 3 * 4 * float(collective[0])  # 3 passes x 4 collectives
        assert 0 < off - on <= tp_comm


def test_pipelined_exposed_closed_forms():
    """A collective of c pipelined in n chunks with a GEMM of g: c / n exposed when the GEMM is
    longer, c - g + g / n when the collective is."""
    from megatron_ext.planner.cost.tp_overlap import bulk_exposed_s, pipelined_exposed_s

    assert pipelined_exposed_s(1.0, 4.0, 8) == pytest.approx(1.0 / 8)
    assert pipelined_exposed_s(4.0, 1.0, 4) == pytest.approx(3.0 + 1.0 / 4)
    assert bulk_exposed_s(1.0, 4.0) == 0.0 and bulk_exposed_s(4.0, 1.0) == 3.0


def test_sequence_parallel_prices_each_collective_and_the_backward_regather():
    """Under SP a layer's forward runs an all-gather and a reduce-scatter per block, each at its
    own curve (gloo's reduce-scatter is not its all-gather); its backward also re-gathers the
    sequence shard of each column-parallel linear's input for the weight gradient (megatron-core
    LinearWithGradAccumulationAndAsyncCommunication.backward), beside the input-gradient GEMM:
    exposed by what outlasts that GEMM. On a profile whose all-gather is slow next to the GEMMs
    the backward pays exactly the two exposed re-gathers more than the forward."""
    from megatron_ext.planner.cost import compute as C
    from megatron_ext.planner.profile.profiles import ClusterProfile, CollectiveCurve
    from megatron_ext.specs import ClusterSpec, LinkSpec

    sizes = (1e3, 1e5, 1e7, 1e9)

    def curve(op, g, per_byte):
        return CollectiveCurve(collective=op, group_size=g, stride=1, ranks_per_node=g,
                               num_bytes=sizes, seconds=tuple(1e-3 + n * per_byte for n in sizes))

    spec = ClusterSpec(name="slow", num_nodes=1, gpus_per_node=4, memory_gib=80.0,
                       peak_flops=1e15,
                       intra_node=LinkSpec(bandwidth_bytes_per_s=1e9, latency_s=1e-5),
                       inter_node=LinkSpec(bandwidth_bytes_per_s=1e9, latency_s=1e-5))
    rates = {"all_reduce": 2e-9, "all_gather": 1e-9, "reduce_scatter": 3e-9,
             "all_to_all": 1e-9, "p2p": 1e-9}
    prof = ClusterProfile(cluster=spec, backend="gloo", device="cpu", overlap_slowdown=1.5,
                          collectives=tuple(curve(op, 4, r) for op, r in rates.items()
                                            if op != "p2p") + (curve("p2p", 2, 1e-9),))
    model = model_preset("llama2-7b")
    training = TrainingSpec(global_batch_size=8, seq_length=1024, precision="bf16",
                            dropout=False)
    cm = CostModel(model, spec, training, comm=prof)
    table = StrategyTable.of([LayerStrategy(tp=4, sp=True, dp=1)])
    costs = cm.layer_costs(table, 1)
    rows = 1024.0
    hidden = rows * model.hidden_size * 2
    ag, rs = prof.collective_time_s("all_gather", 4, 4, hidden), prof.collective_time_s(
        "reduce_scatter", 4, 4, hidden)
    gemms = C.layer_gemms(model, np.array([4]))
    regather = 0.0
    for k, n in (gemms[0], gemms[-2]):
        dgrad = 2.0 * rows * k * n / (1e15 * C.gemm_efficiency(cm.compute, min(rows, k, n)))
        regather += max(0.0, 1.5 * ag - float(np.squeeze(dgrad)))
    assert regather > 0
    assert float(costs.comm_s[0]) == pytest.approx(2 * 2 * (ag + rs) + regather, rel=1e-9)


@pytest.mark.parametrize("barriers", [1, 2])
def test_vocabulary_parallel_passes_hold_their_states_receives_and_ids(barriers):
    """vocab_parallel_state_bytes by hand for pp 4, t_v 1, m 8, bf16 (runtime/vocab/passes.py;
    tools/bench_memory.py measures it exactly at pp 2): c S states (fp32 softmax [n, v], X [n, h],
    with one barrier the fp32 input-gradient partial and label rows), the broadcast receives
    posted W = p + barriers + 2 ahead, every micro-batch's ids (9 n), the first stage's two
    summed embeddings, the last stage's token gradients; the last stage roots X and the token
    gradients, the first the embedding gradient."""

    from megatron_ext.planner.cost.vocab import output_state_bound, vocab_parallel_state_bytes

    model = model_preset("llama2-7b")  # V 32000 padded to 32256 (128 x 4): 8064 rows, h 4096
    n, h, v, e, m, pp = 2048.0, 4096, 8064, 2, 8, 4
    c = output_state_bound(pp, m)
    assert list(c) == [2, 2, 2, 3]
    got = vocab_parallel_state_bytes(model, VocabStrategy(mode="vocab_parallel", tp=1,
                                                          algorithm=barriers),
                                     pp, n, m, element_bytes=e, output_states=c)
    state = n * v * 4 + n * h * e + (2 * n * h * 4 if barriers == 1 else 0) + (29 + 48) * n
    w = pp + barriers + 2
    x_posted = [min(w + int(k), m) - int(k) for k in c]
    want = [c[k] * state + 9 * n * m for k in range(pp)]
    for k in range(pp):
        if k != pp - 1:  # X and the token gradients come from the last stage's root
            want[k] += x_posted[k] * n * h * e + min(w, m) * 4 * n
        if k != 0:  # the embedding gradient from the first stage's root
            want[k] += min(w, m) * n * h * e
    want[0] += 2 * n * h * e
    want[-1] += barriers * 4 * n
    assert list(got) == pytest.approx(want, rel=1e-12)
