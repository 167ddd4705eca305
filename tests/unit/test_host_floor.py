"""Fixed host-side costs of the GPU cost model (compute.py HOST_*): the floor of a layer pass,
the per-micro-batch term, and that both vanish where compute dominates or a measured profile
already holds them. Expected values come from the closed forms in compute.py's docstrings."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_ext.errors import PlanError
from megatron_ext.plan import LayerStrategy, PlanLayout, VocabStrategy
from megatron_ext.planner.cost import compute as C
from megatron_ext.planner.cost.evaluate import evaluate
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.space import StrategyTable
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.presets import cluster_preset, model_preset
from megatron_ext.specs import ModelSpec

OFF = C.ComputeProfile(host_kernel_s=0.0, host_collective_step_s=0.0, host_microbatch_s=0.0)


def tiny(layers: int) -> ModelSpec:
    """A model whose GPU time is negligible next to the host floor."""
    return ModelSpec(name="tiny", num_layers=layers, hidden_size=64, ffn_hidden_size=256,
                     num_attention_heads=4, num_query_groups=4, vocab_size=128,
                     max_position_embeddings=32, position_embedding="learned_absolute",
                     activation="gelu", normalization="LayerNorm", tied_embeddings=True)


def test_soft_maximum_is_bounded_by_max_and_sum():
    gpu = np.array([0.0, 1e-4, 1e-3, 3e-3, 1e-2, 1.0])
    for host in (0.0, 5e-4, 3e-3):
        for k in (1.5, 3.5, 6.0):
            t = np.asarray(C.host_bound_s(gpu, host, k))
            assert np.all(t >= np.maximum(gpu, host) - 1e-15)
            assert np.all(t <= gpu + host + 1e-15)
            assert np.all(np.diff(t) > 0)  # monotone in the GPU time
    assert C.host_bound_s(2e-3, 0.0, 3.5) == 2e-3  # no host floor: the GPU time exactly
    assert float(C.host_bound_s(1.0, 1e-3, 3.5)) == pytest.approx(1.0, rel=1e-9)


def test_kernel_counts_follow_the_layer():
    gpt = model_preset("gpt3-1.3b")
    llama = model_preset("llama2-7b")
    unfused = C.layer_forward_kernels(gpt, flash_attention=False, dropout=True)
    assert unfused == 2 + 4 + 2 + 1 + 6  # norms, GEMMs, bias-dropout-adds, GeLU, attention
    assert C.layer_forward_kernels(gpt, flash_attention=True, dropout=True) == unfused - 5
    flash_rope = C.layer_forward_kernels(llama, flash_attention=True, dropout=False)
    assert flash_rope == 2 + 4 + 2 + 1 + 1 + 2
    host = C.A100_HOST
    f, b, a = C.layer_host_s(gpt, host, tp=np.array([1, 2, 8]), flash_attention=False,
                             dropout=True)
    k, s = host.kernel_s, host.collective_step_s
    assert f[0] == pytest.approx(unfused * k)
    assert b[0] == pytest.approx(C.BACKWARD_KERNELS_PER_FORWARD * unfused * k)
    # two collectives per pass, each 2 phases of t - 1 ring steps
    assert f[2] == pytest.approx(unfused * k + 2 * k + 4 * 7 * s)
    assert np.all(np.diff(f) > 0) and np.all(np.diff(b) > 0)
    assert a == pytest.approx(6 * k)


def test_fixed_cost_scales_with_layers_times_microbatches():
    """A model too small to load the GPU: the iteration grows by layers x micro-batches x the
    host time of forward + recomputed forward + backward, plus micro-batches x the per-micro-
    batch term."""
    cluster = cluster_preset("dgx-a100-80g", num_nodes=1)
    prof = C.ComputeProfile()
    s = LayerStrategy(tp=1, dp=8, zero=0, recompute="full")
    vocab = VocabStrategy(mode="tp", tp=1)

    def iteration(layers: int, m: int, compute: C.ComputeProfile) -> float:
        cm = CostModel(tiny(layers), cluster,
                       TrainingSpec(global_batch_size=8 * m, seq_length=32), compute=compute)
        return evaluate(cm, PlanLayout(pp=1, stages=((0, layers),), layers=(s,) * layers,
                                       vocab=vocab, micro_batch_size=8)).iteration_s

    t = TrainingSpec(global_batch_size=8, seq_length=32)
    host = prof.host_for(cluster)
    f, b, _ = C.layer_host_s(tiny(1), host, tp=1, flash_attention=t.flash_attention,
                             dropout=t.dropout)
    per_layer = 2 * float(f) + float(b)
    for layers, m in ((4, 2), (8, 3)):
        grow_layers = iteration(2 * layers, m, prof) - iteration(layers, m, prof)
        assert grow_layers == pytest.approx(layers * m * per_layer, rel=0.03)
        grow_mbs = iteration(layers, 2 * m, prof) - iteration(layers, m, prof)
        assert grow_mbs == pytest.approx(m * (layers * per_layer + host.microbatch_s),
                                         rel=0.03)
    # without the host terms the same model costs a small fraction of it
    assert iteration(8, 3, OFF) < 0.1 * iteration(8, 3, prof)


def test_compute_bound_layers_keep_their_gpu_time():
    """GPT-3 175B at TP 8, micro-batch 1, seq 2048 (SC'21's layout): the floor adds < 1%."""
    model = model_preset("gpt3-175b")
    cluster = cluster_preset("dgx-a100-80g", num_nodes=1)
    table = StrategyTable.of([LayerStrategy(tp=8, dp=1, recompute="full")])
    training = TrainingSpec(global_batch_size=8, seq_length=2048)
    on = CostModel(model, cluster, training).layer_costs(table, 1)
    off = CostModel(model, cluster, training, compute=OFF).layer_costs(table, 1)
    for field in ("forward_s", "backward_s", "recompute_s"):
        ratio = getattr(on, field)[0] / getattr(off, field)[0]
        assert 1.0 <= ratio < 1.01, field


def test_small_layers_are_host_bound_and_grow_with_the_micro_batch():
    """GPT 0.35B (24 x 1024, seq 1024, vTrain's shape) on one A100: a layer-micro-batch costs
    at least its host floor and grows with the micro-batch once compute passes the floor."""
    model = dataclasses.replace(model_preset("gpt3-1.3b"), hidden_size=1024,
                                ffn_hidden_size=4096, max_position_embeddings=1024)
    cluster = cluster_preset("dgx-a100-40g", num_nodes=1)
    table = StrategyTable.of([LayerStrategy(tp=1, dp=1, recompute="full")])
    training = TrainingSpec(global_batch_size=64, seq_length=1024, precision="fp16",
                            flash_attention=False)
    cm = CostModel(model, cluster, training)
    per = [float(cm.layer_costs(table, b).forward_s[0] + cm.layer_costs(table, b).backward_s[0])
           for b in (1, 2, 4, 8)]
    f, b, _ = C.layer_host_s(model, cm.compute.host_for(cluster), tp=1, flash_attention=False,
                             dropout=True)
    assert per[0] >= 2 * float(f) + float(b)
    assert np.all(np.diff(per) > 0)
    assert per[3] / per[2] > 1.7  # compute-bound by micro-batch 8


def test_host_constants_per_preset_and_profile():
    """GPU presets carry the fitted constants; other clusters none unless a profile sets them;
    a profile's explicit value (0 = off) wins; negative values are refused."""
    a100 = cluster_preset("dgx-a100-40g", num_nodes=1)
    assert C.ComputeProfile().host_for(a100) == C.A100_HOST
    assert C.ComputeProfile().host_for(cluster_preset("dgx-a100-80g")) == C.A100_HOST
    custom = dataclasses.replace(a100, name="measured-gloo")
    assert C.ComputeProfile().host_for(custom) == C.HostConstants()
    prof = C.ComputeProfile.from_dict({"host_kernel_s": 0, "host_microbatch_s": 0.001})
    assert prof.host_for(a100) == C.HostConstants(
        kernel_s=0.0, collective_step_s=C.A100_HOST.collective_step_s, microbatch_s=0.001)
    assert prof.host_for(custom).microbatch_s == 0.001
    with pytest.raises(PlanError, match="host_collective_step_s=-1"):
        C.ComputeProfile.from_dict({"host_collective_step_s": -1})
    with pytest.raises(PlanError, match="host_overlap_power"):
        C.ComputeProfile.from_dict({"host_overlap_power": 0})


def test_moe_layers_get_the_host_floor_too():
    """MoE layers are priced with at least the dense layer's host floor (a lower bound: the
    router and dispatch launch more kernels)."""
    from megatron_ext.planner.cost import moe as M

    model = model_preset("mixtral-8x7b")
    cluster = cluster_preset("dgx-h100", num_nodes=1)
    training = TrainingSpec(global_batch_size=8, seq_length=128)
    s = LayerStrategy(tp=1, dp=8, zero=1, ep=8)
    table = StrategyTable.of([s])
    moe = M.moe_layer_costs(CostModel(model, cluster, training), table, 8)
    off = M.moe_layer_costs(CostModel(model, cluster, training, compute=OFF), table, 8)
    f, b, _ = C.layer_host_s(model, C.ComputeProfile().host_for(cluster), tp=1,
                             flash_attention=training.flash_attention, dropout=training.dropout)
    assert moe.forward_s[0] >= float(f) > off.forward_s[0]
    assert moe.backward_s[0] >= float(b) > off.backward_s[0]


def test_stated_kernel_counts_and_synchronous_launches():
    """A profile's own kernel counts replace the fused layer's (backward: 2x forward unless
    stated), and power 1 (CUDA_LAUNCH_BLOCKING=1) adds host and GPU time exactly."""
    model = model_preset("llama2-7b")
    host = C.A100_HOST
    kw = dict(tp=1, flash_attention=True, dropout=False)
    f0, b0, a0 = C.layer_host_s(model, host, **kw)
    fused = C.layer_forward_kernels(model, flash_attention=True, dropout=False)
    assert float(f0) == pytest.approx(fused * host.kernel_s)
    assert float(b0) == pytest.approx(C.BACKWARD_KERNELS_PER_FORWARD * fused * host.kernel_s)
    f1, b1, a1 = C.layer_host_s(model, host, forward_kernels=38, **kw)
    assert (float(f1), float(b1)) == pytest.approx((38 * host.kernel_s, 76 * host.kernel_s))
    _, b2, _ = C.layer_host_s(model, host, forward_kernels=38, backward_kernels=94, **kw)
    assert float(b2) == pytest.approx(94 * host.kernel_s)
    assert a1 == a0  # selective recompute replays core attention only
    gpu, hst = np.array([1e-3, 5e-3]), np.array([2e-3, 1e-3])
    np.testing.assert_allclose(C.host_bound_s(gpu, hst, 1.0), gpu + hst, rtol=1e-12)
    assert np.all(C.host_bound_s(gpu, hst, C.HOST_OVERLAP_POWER) < gpu + hst)
    # 0 stands for the fused count; a negative count is refused with the field named
    prof = C.ComputeProfile.from_dict({"layer_forward_kernels": 0, "layer_backward_kernels": 94})
    assert (prof.layer_forward_kernels, prof.layer_backward_kernels) == (0.0, 94.0)
    with pytest.raises(PlanError, match="layer_forward_kernels"):
        C.ComputeProfile.from_dict({"layer_forward_kernels": -3})
    # through the cost model: the stated counts make a host-bound layer slower
    cluster = cluster_preset("dgx-a100-80g", num_nodes=1)
    training = TrainingSpec(global_batch_size=8, seq_length=256)
    table = StrategyTable.of([LayerStrategy(tp=1, dp=8)])
    base = CostModel(model, cluster, training).layer_costs(table, 1)
    sync = CostModel(model, cluster, training, compute=C.ComputeProfile(
        host_overlap_power=1.0, layer_forward_kernels=38, layer_backward_kernels=94)
    ).layer_costs(table, 1)
    assert sync.forward_s[0] > base.forward_s[0] and sync.backward_s[0] > base.backward_s[0]


def test_extra_elementwise_passes_cost_hbm_time():
    """layer_extra_elementwise_passes adds that many passes over [tokens, hidden / tp] to the
    forward's HBM traffic and twice as many to the backward's; GEMMs and attention unchanged."""
    model = model_preset("llama2-7b")
    cluster = cluster_preset("dgx-a100-80g", num_nodes=1)
    kw = dict(b=2, seq_length=4096, tp=np.array([1, 2]), sp=np.array([False, False]),
              seq_shards=1, element_bytes=2)
    base = C.layer_compute(model, cluster, C.ComputeProfile(), **kw)
    prof = C.ComputeProfile(layer_extra_elementwise_passes=33)
    more = C.layer_compute(model, cluster, prof, **kw)
    one_pass = 2 * 2 * 4096 * model.hidden_size / np.array([1, 2]) / prof.hbm_for(cluster)
    np.testing.assert_allclose(more.forward_s - base.forward_s, 33 * one_pass, rtol=1e-9)
    np.testing.assert_allclose(more.backward_s - base.backward_s, 66 * one_pass, rtol=1e-9)
    np.testing.assert_allclose(more.attention_forward_s, base.attention_forward_s)
