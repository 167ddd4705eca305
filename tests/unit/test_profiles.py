"""Profile files: JSON round trips, one-line validation errors, curve interpolation/extrapolation,
NNLS fits, and the profile-fed cost model against its inputs. Expected values are computed from
closed forms, not from the code under test."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from megatron_ext.errors import PlanError
from megatron_ext.plan import LayerStrategy, PlanLayout, VocabStrategy
from megatron_ext.planner.cost.comm import GroupLayout
from megatron_ext.planner.cost.compute import HostConstants
from megatron_ext.planner.cost.evaluate import evaluate
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.profile.cost import (
    ProfiledCostModel,
    fitted_compute_profile,
    predict_iteration_s,
    stage_work,
)
from megatron_ext.planner.profile.fit import layer_features
from megatron_ext.planner.profile.profiles import (
    ClusterProfile,
    CollectiveCurve,
    LayerSample,
    ModelProfile,
    OptimizerSample,
    VocabSample,
)
from megatron_ext.planner.space import StrategyTable
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.presets import cluster_preset, model_preset
from megatron_ext.specs import ClusterSpec, LinkSpec

MODEL = model_preset("tiny-gpt")
SIZES = (1e3, 1e4, 1e5, 1e6)


def power_law_curve(op: str = "all_reduce", g: int = 4, q: int = 4, k: float = 0.5,
                    c: float = 1e-6) -> CollectiveCurve:
    """t = c * n^k: log-log interpolation is exact on it."""
    return CollectiveCurve(collective=op, group_size=g, stride=1, ranks_per_node=q,
                           num_bytes=SIZES, seconds=tuple(c * n**k for n in SIZES))


def cluster_profile() -> ClusterProfile:
    spec = ClusterSpec(name="test", num_nodes=2, gpus_per_node=2, memory_gib=8.0, peak_flops=1e11,
                       intra_node=LinkSpec(bandwidth_bytes_per_s=1e9, latency_s=1e-5),
                       inter_node=LinkSpec(bandwidth_bytes_per_s=1e8, latency_s=1e-4))
    curves = tuple(power_law_curve(op, g, q) for op in ("all_reduce", "all_gather",
                                                          "reduce_scatter", "all_to_all")
                   for g, q in ((2, 2), (2, 1), (4, 2)))
    curves += (power_law_curve("p2p", 2, 2, k=0.6),)
    return ClusterProfile(cluster=spec, backend="nccl", device="gpu", overlap_slowdown=1.3,
                          compute_slots_per_node=None, collectives=curves)


def true_layer_time(tp, sp, b, s, coef):
    return layer_features(MODEL, tp=tp, sp=sp, micro_batch_size=b, seq_length=s) @ coef


LAYER_COEF = {"forward_s": np.array([2e-4, 1e-10, 3e-10, 5e-9]),
              "backward_s": np.array([3e-4, 2e-10, 6e-10, 1e-8]),
              "recompute_s": np.array([2e-4, 1e-10, 3e-10, 5e-9]),
              "selective_recompute_s": np.array([1e-5, 0.0, 3e-10, 0.0])}


def model_profile() -> ModelProfile:
    layers = []
    for tp in (1, 2, 4):
        for sp in (False, True) if tp > 1 else (False,):
            for b in (1, 2, 4):
                for s in (32, 64):
                    times = {k: float(true_layer_time(tp, sp, b, s, c))
                             for k, c in LAYER_COEF.items()}
                    layers.append(LayerSample(tp=tp, sp=sp, micro_batch_size=b, seq_length=s,
                                              **times))
    vocab = tuple(VocabSample(tp=tp, tokens=n, embedding_forward_s=1e-4 + 1e-9 * n,
                              embedding_backward_s=2e-4 + 2e-9 * n,
                              output_forward_s=1e-4 + 4e-11 * n * 64 * 512 / tp,
                              output_backward_s=2e-4 + 8e-11 * n * 64 * 512 / tp)
                  for tp in (1, 2, 4) for n in (32, 64, 128))
    opt = tuple(OptimizerSample(num_params=n, step_s=1e-4 + 5e-9 * n)
                for n in (10**4, 10**5, 10**6))
    return ModelProfile(model=MODEL, precision="fp32", device="cpu", concurrency=4,
                        layers=tuple(layers), vocab=vocab, optimizer=opt)


# ---- JSON ----------------------------------------------------------------------------------


def test_profiles_round_trip_through_json(tmp_path):
    cp, mp = cluster_profile(), model_profile()
    cp.save(tmp_path / "c.json")
    mp.save(tmp_path / "m.json")
    assert ClusterProfile.load(tmp_path / "c.json") == cp
    loaded = ModelProfile.load(tmp_path / "m.json")
    assert loaded == mp
    assert loaded.layer_time_s("forward_s", tp=2, sp=True, micro_batch_size=3,
                               seq_length=48) == pytest.approx(
        mp.layer_time_s("forward_s", tp=2, sp=True, micro_batch_size=3, seq_length=48))


def _cluster_json() -> dict:
    return json.loads(json.dumps(cluster_profile().to_dict()))


def _model_json() -> dict:
    return json.loads(json.dumps(model_profile().to_dict()))


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(extra=1), "extra is not a known field"),
    (lambda d: d.update(schema_version=2), "schema_version=2 is not supported"),
    (lambda d: d.update(kind="model_profile"), "kind='model_profile'"),
    (lambda d: d.pop("backend"), "backend is missing"),
    (lambda d: d.update(overlap_slowdown=0.5), "overlap_slowdown=0.5 must be >= 1"),
    (lambda d: d["collectives"][0].update(seconds=[1, 2, -3, 4]), "seconds must all be > 0"),
    (lambda d: d["collectives"][0].update(num_bytes=[1, 3, 2, 4]), "strictly increasing"),
    (lambda d: d["collectives"][0].update(collective="gather"), "collectives[0].collective="),
    (lambda d: d["collectives"][1].update(group_size="2"), "collectives[1].group_size='2'"),
    (lambda d: d["collectives"][2].update(typo=1), "collectives[2].typo is not a known field"),
    (lambda d: d["cluster"].update(num_nodes=0), "cluster.num_nodes=0 must be >= 1"),
    (lambda d: d.update(compute_slots_per_node=3), "compute_slots_per_node=3.0 must be in"),
    (lambda d: d.update(compute_slots_per_node="2"), "compute_slots_per_node='2'"),
    (lambda d: d.update(compute_burst_s=-0.1), "compute_burst_s=-0.1 must be >= 0"),
    (lambda d: d.update(comm_cpu_share=1.5), "comm_cpu_share=1.5 must be in [0, 1]"),
])
def test_cluster_profile_errors_are_one_line_and_name_the_field(tmp_path, mutate, needle):
    data = _cluster_json()
    mutate(data)
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(PlanError) as err:
        ClusterProfile.load(tmp_path / "c.json")
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(layers=[]), "layers is empty"),
    (lambda d: d["layers"][3].update(forward_s=0), "layers[3].forward_s=0 must be > 0"),
    (lambda d: d["layers"][0].update(sp=True), "layers[0].sp=true needs tp > 1"),
    (lambda d: d["layers"][0].update(tp=3), "layers[0].tp=3 does not divide"),
    (lambda d: d["layers"][1].update(recompute_s=-1.0), "layers[1].recompute_s=-1.0"),
    (lambda d: d["layers"][1].pop("backward_s"), "layers[1].backward_s is missing"),
    (lambda d: d["vocab"][0].update(tokens=1.5), "vocab[0].tokens=1.5 must be an integer"),
    (lambda d: d["optimizer"][0].update(step_s="fast"), "optimizer[0].step_s='fast'"),
    (lambda d: d.update(precision="fp8"), "precision='fp8' must be one of"),
    (lambda d: d.update(sharing_slowdown=0.5), "sharing_slowdown=0.5 must be >= 1"),
    (lambda d: d["model"].update(hidden_size=-1), "model.hidden_size=-1"),
    (lambda d: d.update(kind="cluster_profile"), "kind='cluster_profile'"),
])
def test_model_profile_errors_are_one_line_and_name_the_field(tmp_path, mutate, needle):
    data = _model_json()
    mutate(data)
    (tmp_path / "m.json").write_text(json.dumps(data))
    with pytest.raises(PlanError) as err:
        ModelProfile.load(tmp_path / "m.json")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_unreadable_profile_files_are_plan_errors(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    for loader in (ClusterProfile.load, ModelProfile.load):
        with pytest.raises(PlanError, match="not valid JSON"):
            loader(tmp_path / "bad.json")
        with pytest.raises(PlanError, match="cannot read"):
            loader(tmp_path / "missing.json")


# ---- curves --------------------------------------------------------------------------------


def test_curve_is_exact_at_points_and_log_log_between():
    curve = power_law_curve(k=0.7, c=3e-7)
    np.testing.assert_allclose(curve.time_s(np.array(SIZES)), [3e-7 * n**0.7 for n in SIZES],
                               rtol=1e-12)
    mid = np.geomspace(SIZES[0], SIZES[-1], 50)
    # a power law is a straight line in log-log space, so interpolation reproduces it exactly
    np.testing.assert_allclose(curve.time_s(mid), 3e-7 * mid**0.7, rtol=1e-9)


def test_curve_extrapolates_alpha_beta_and_stays_monotone():
    seconds = (1e-4, 1.1e-4, 3e-4, 2.1e-3)  # latency-bound, then ~1 GB/s
    curve = CollectiveCurve(collective="all_reduce", group_size=2, stride=1, ranks_per_node=2,
                            num_bytes=SIZES, seconds=seconds)
    slope = np.polyfit(SIZES[1:], seconds[1:], 1)[0]  # bandwidth of the three largest sizes
    assert curve.time_s(1e7) == pytest.approx(seconds[-1] + (1e7 - 1e6) * slope, rel=1e-9)
    small = curve.time_s(np.array([1.0, 10.0, 100.0]))
    assert np.all(small <= seconds[0]) and np.all(small >= curve.fit.alpha_s * 0.999)
    grid = np.geomspace(1, 1e8, 400)
    assert np.all(np.diff(curve.time_s(grid)) >= -1e-15)


def test_cluster_profile_lookup_by_placement_and_fallback():
    cp = cluster_profile()
    n = 2e5
    expected = 1e-6 * n**0.5
    assert cp.collective_time_s("all_reduce", 2, "intra", n) == pytest.approx(expected)
    assert cp.collective_time_s("all_reduce", 2, "inter", n) == pytest.approx(expected)
    assert cp.collective_time_s("all_reduce", 1, "intra", n) == 0.0
    # unmeasured placement (8 ranks): ring formula on the inter-node link (it crosses nodes)
    inter = cp.cluster.inter_node
    assert cp.collective_time_s("all_reduce", 8, 2, n) == pytest.approx(
        14 * inter.latency_s + 2 * 7 / 8 * n / inter.bandwidth_bytes_per_s)
    # the planner's CommModel protocol: layout objects with .size and .ranks_per_node
    assert cp.time_s("all_gather", n, GroupLayout(size=4, ranks_per_node=2)) == pytest.approx(
        expected)
    assert cp.time_s("p2p", n, GroupLayout(size=2, ranks_per_node=2)) == pytest.approx(
        1e-6 * n**0.6)
    with pytest.raises(ValueError, match="layout="):
        cp.collective_time_s("all_reduce", 2, "diagonal", n)


# ---- fits and the cost model ---------------------------------------------------------------


def test_layer_fit_recovers_a_cost_law_in_its_span():
    mp = model_profile()
    for phase, coef in LAYER_COEF.items():
        for tp, sp, b, s in ((1, False, 3, 48), (4, True, 8, 128), (2, False, 1, 16)):
            assert mp.layer_time_s(phase, tp=tp, sp=sp, micro_batch_size=b, seq_length=s) == \
                pytest.approx(float(true_layer_time(tp, sp, b, s, coef)), rel=1e-6)
        assert mp.fit_report()[phase][1] < 1e-6
    assert mp.optimizer_step_s(2e6) == pytest.approx(1e-4 + 5e-9 * 2e6, rel=1e-6)
    assert mp.activation_bytes(tp=1, sp=False, micro_batch_size=1, seq_length=32) is None


def test_gloo_profiles_price_the_straight_line_through_every_point():
    """gloo on CPU ranks: one fixed cost per call plus bytes over one bandwidth, its single
    points scattered by the scheduler; the least-squares line t = a + b n through all (made
    non-decreasing) points prices every size, exact when the points lie on a line."""
    sizes = (1e3, 1e4, 1e5, 1e6)
    line = CollectiveCurve(collective="all_gather", group_size=2, stride=1, ranks_per_node=2,
                           num_bytes=sizes, seconds=tuple(2e-3 + n * 1e-9 for n in sizes))
    noisy = dataclasses.replace(line, seconds=(4e-3, 2e-3, 2.1e-3, 3e-3))
    base = dataclasses.replace(cluster_profile(), backend="gloo", device="cpu")
    exact = dataclasses.replace(base, collectives=(line,))
    assert exact.collective_time_s("all_gather", 2, 2, 3e5) == pytest.approx(2e-3 + 3e-4)
    scattered = dataclasses.replace(base, collectives=(noisy,))
    seconds = np.minimum.accumulate(np.array(noisy.seconds)[::-1])[::-1]  # (2, 2, 2.1, 3) ms
    design = np.stack([np.ones(4), np.array(sizes)], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    assert scattered.collective_time_s("all_gather", 2, 2, 1e4) == pytest.approx(a + b * 1e4)
    # the same points under NCCL keep the exact interpolation
    nccl = dataclasses.replace(scattered, backend="nccl")
    assert nccl.collective_time_s("all_gather", 2, 2, 1e4) == pytest.approx(2e-3)


def test_cluster_profile_is_a_comm_model_for_the_planner():
    cp = cluster_profile()
    training = TrainingSpec(global_batch_size=8, seq_length=64, precision="fp32")
    cm = CostModel(MODEL, cp.cluster, training, comm=cp)
    bytes_ = np.array([5e4, 2e5])
    np.testing.assert_allclose(cm.collective_s("all_reduce", bytes_, np.array([2, 2]), 1),
                               1e-6 * bytes_**0.5)


def test_profiled_cost_model_uses_measured_layer_times():
    cp, mp = cluster_profile(), model_profile()
    training = TrainingSpec(global_batch_size=8, seq_length=64, precision="fp32")
    cm = ProfiledCostModel(MODEL, cp.cluster, training, comm=cp, model_profile=mp)
    strategies = [LayerStrategy(tp=1, dp=4), LayerStrategy(tp=1, dp=4, recompute="full"),
                  LayerStrategy(tp=1, dp=4, recompute="selective")]
    costs = cm.layer_costs(StrategyTable.of(strategies), micro_batch_size=8)
    b, s = 2, 64  # 8 samples over dp=4, no tp/cp/ulysses communication inside the layer
    fwd, bwd, rc, sel = (float(true_layer_time(1, False, b, s, LAYER_COEF[k])) for k in
                         ("forward_s", "backward_s", "recompute_s", "selective_recompute_s"))
    np.testing.assert_allclose(costs.forward_s, [fwd] * 3, rtol=1e-6)
    np.testing.assert_allclose(costs.backward_s, [bwd, bwd + rc, bwd + sel], rtol=1e-6)
    np.testing.assert_allclose(costs.recompute_s, [0.0, rc, sel], rtol=1e-6, atol=1e-12)
    ev = evaluate(cm, PlanLayout(pp=1, stages=((0, 4),), layers=(strategies[0],) * 4,
                                 vocab=VocabStrategy(), micro_batch_size=8))
    assert ev.iteration_s > 4 * (fwd + bwd)  # one micro-batch through 4 layers, plus the rest


def test_fitted_compute_profile_reproduces_measured_rates():
    cp, mp = cluster_profile(), model_profile()
    prof = fitted_compute_profile(mp, cp.cluster)
    # output GEMM: 4e-11 s per n*h*V_t = 2e-11 s per FLOP at a peak of 1e11 FLOP/s: 50%
    assert prof.gemm_efficiency == pytest.approx(0.5, rel=1e-6)
    assert prof.hbm_bytes_per_s == pytest.approx(30.0 / 5e-9, rel=1e-6)
    # the measured layer and step times already hold the host side: no host floor on top
    assert prof.host_for(cluster_preset("dgx-a100-80g")) == HostConstants()
    with pytest.raises(PlanError, match="measured on model 'tiny-gpt'"):
        ProfiledCostModel(dataclasses.replace(MODEL, hidden_size=128), cp.cluster,
                          TrainingSpec(global_batch_size=8, seq_length=64), model_profile=mp)


def test_shared_compute_iteration_time():
    """4 ranks per node, each 2x slower when all 4 compute (2 slots). stage_work splits
    evaluate's stage sums into compute and communication without losing any; with every rank
    busy (pp = 1) compute takes 4/2 times as long and communication does not share; with no
    sharing measured the prediction is the planner's."""
    cluster = dataclasses.replace(cluster_profile().cluster, num_nodes=1, gpus_per_node=4)
    training = TrainingSpec(global_batch_size=8, seq_length=64, precision="fp32")
    shared = dataclasses.replace(model_profile(), concurrency=4, sharing_slowdown=2.0)
    comm = dataclasses.replace(cluster_profile(), cluster=cluster)
    cm = ProfiledCostModel(MODEL, cluster, training, comm=comm, model_profile=shared)
    assert cm.compute_slots_per_node() == 2.0
    layout = {"layers": (LayerStrategy(tp=2, dp=2, zero=1),) * 4, "vocab": VocabStrategy(),
              "micro_batch_size": 4}
    m = 2
    two_stages = {**layout, "layers": (LayerStrategy(tp=2, dp=1),) * 4}  # 2 ranks per stage
    unshared = ProfiledCostModel(MODEL, cluster, training, comm=comm,
                                 model_profile=dataclasses.replace(shared, concurrency=1))
    for pp, stages, lay in ((1, ((0, 4),), layout), (2, ((0, 1), (1, 4)), two_stages)):
        ev = evaluate(unshared, PlanLayout(pp=pp, stages=stages, **lay))
        w = stage_work(unshared, PlanLayout(pp=pp, stages=stages, **lay))
        busy = m * (w.forward_compute_s + w.forward_comm_s + w.backward_compute_s
                    + w.backward_comm_s) + w.tail_comm_s + w.optimizer_s
        np.testing.assert_allclose(busy, ev.stage_busy_s, rtol=1e-9)
        # sharing hides communication behind the other tensor-parallel groups' compute
        # (hidden_comm_s): two tp2 groups on 4 ranks over 2 slots hide up to one compute's
        # worth (4/2 - max(1, 2/2)); one tp2 group per stage of 2 ranks hides nothing
        hid = stage_work(cm, PlanLayout(pp=pp, stages=stages, **lay))
        np.testing.assert_allclose(hid.forward_compute_s, w.forward_compute_s, rtol=1e-12)
        expect = (np.maximum(0.0, w.forward_comm_s - w.forward_compute_s) if pp == 1
                  else w.forward_comm_s)
        np.testing.assert_allclose(hid.forward_comm_s, expect, rtol=1e-12, atol=1e-15)
    assert float(w.forward_comm_s.min()) > 0  # tp2 all-reduces are communication
    tp4 = {**layout, "layers": (LayerStrategy(tp=4, dp=1),) * 4, "vocab": VocabStrategy(tp=4)}
    one_group = PlanLayout(pp=1, stages=((0, 4),), **tp4)
    np.testing.assert_allclose(stage_work(cm, one_group).forward_comm_s,
                               stage_work(unshared, one_group).forward_comm_s, rtol=1e-12)
    w = stage_work(cm, PlanLayout(pp=1, stages=((0, 4),), **layout))
    compute = m * (w.forward_compute_s + w.backward_compute_s) + w.optimizer_s
    comm_s = m * (w.forward_comm_s + w.backward_comm_s) + w.tail_comm_s
    assert predict_iteration_s(cm, PlanLayout(pp=1, stages=((0, 4),), **layout)) == pytest.approx(
        float(4 / 2 * compute[0] + comm_s[0]), rel=1e-9)
    # no sharing measured anywhere: the planner's time
    alone = ProfiledCostModel(MODEL, cluster, training, comm=comm,
                              model_profile=dataclasses.replace(model_profile(), concurrency=1))
    assert alone.compute_slots_per_node() is None
    assert predict_iteration_s(alone, PlanLayout(pp=2, stages=((0, 1), (1, 4)), **two_stages)) == (
        evaluate(alone, PlanLayout(pp=2, stages=((0, 1), (1, 4)), **two_stages)).iteration_s)
    # the cluster profile's slots apply when the model profile measured no sharing
    with_slots = dataclasses.replace(comm, compute_slots_per_node=2.0)
    cm2 = ProfiledCostModel(MODEL, cluster, training, comm=with_slots,
                            model_profile=dataclasses.replace(model_profile(), concurrency=1))
    assert cm2.compute_slots_per_node() == 2.0


def test_transfers_beside_compute_take_their_cpu_share_on_shared_cores():
    """On CPU ranks a collective is CPU work: what the other tensor-parallel groups hide, and
    the data-parallel reduction overlapped with backward, still take the profile's
    comm_cpu_share of the node's slots. In solo-compute seconds per rank that is
    share * hidden * slots / ranks per node (4 ranks over 2 slots: share * hidden / 2); with a
    share of 0 (a GPU profile, or one that predates it) nothing changes."""
    cluster = dataclasses.replace(cluster_profile().cluster, num_nodes=1, gpus_per_node=4)
    training = TrainingSpec(global_batch_size=8, seq_length=64, precision="fp32",
                            overlap_grad_reduce=True)
    shared = dataclasses.replace(model_profile(), concurrency=4, sharing_slowdown=2.0)
    comm = dataclasses.replace(cluster_profile(), cluster=cluster)
    layout = PlanLayout(pp=1, stages=((0, 4),), layers=(LayerStrategy(tp=2, dp=2),) * 4,
                        vocab=VocabStrategy(), micro_batch_size=4)
    free = stage_work(ProfiledCostModel(MODEL, cluster, training, comm=comm,
                                        model_profile=shared), layout)
    busy = stage_work(ProfiledCostModel(
        MODEL, cluster, training, comm=dataclasses.replace(comm, comm_cpu_share=0.8),
        model_profile=shared), layout)
    unshared = stage_work(ProfiledCostModel(
        MODEL, cluster, training, comm=comm,
        model_profile=dataclasses.replace(shared, concurrency=1)), layout)
    hidden_f = unshared.forward_comm_s - free.forward_comm_s
    assert float(hidden_f.min()) > 0
    np.testing.assert_allclose(busy.forward_compute_s,
                               free.forward_compute_s + 0.8 * hidden_f / 2, rtol=1e-12)
    sums = stage_sums_of(ProfiledCostModel(MODEL, cluster, training, comm=comm,
                                           model_profile=shared), layout)
    hidden_tail = sums["sync"] + sums["gather"] - free.tail_comm_s
    hidden_b = unshared.backward_comm_s - free.backward_comm_s
    m = 8 // 4
    np.testing.assert_allclose(busy.backward_compute_s, free.backward_compute_s
                               + 0.8 * (hidden_b + hidden_tail / m) / 2, rtol=1e-12)
    np.testing.assert_allclose(busy.forward_comm_s, free.forward_comm_s, rtol=1e-12)


def stage_sums_of(cm: CostModel, layout: PlanLayout) -> dict:
    from megatron_ext.planner.cost.evaluate import stage_sums

    return stage_sums(cm, layout).arr


def test_disturbed_samples_do_not_bend_the_fits():
    """Other processes only add time: a small message measured slower than a larger one takes
    the larger one's time, and a layer sample far above the fit is left out of it."""
    curve = CollectiveCurve(collective="all_gather", group_size=2, stride=1, ranks_per_node=2,
                            num_bytes=SIZES, seconds=(5e-4, 1e-4, 2e-4, 1e-3))
    assert curve.time_s(SIZES[0]) == pytest.approx(1e-4)
    assert curve.time_s(SIZES[-1]) == pytest.approx(1e-3)
    clean = model_profile()
    layers = list(clean.layers)
    layers[5] = dataclasses.replace(layers[5], forward_s=3 * layers[5].forward_s)
    noisy = dataclasses.replace(clean, layers=tuple(layers))
    kw = {"tp": 2, "sp": True, "micro_batch_size": 3, "seq_length": 48}
    assert noisy.layer_time_s("forward_s", **kw) == pytest.approx(
        clean.layer_time_s("forward_s", **kw), rel=1e-6)
    assert noisy.fit_report()["forward_s"][1] == pytest.approx(2 / 3, rel=1e-3)
