"""FP8 in the cost model: GEMM gain by shape, what each recipe keeps in memory, layers kept in
bf16 priced as bf16, and `megatron-ext search --fp8-format hybrid` on H100 end to end."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from megatron_ext.cli import main
from megatron_ext.errors import PlanError
from megatron_ext.plan import LayerStrategy, ParallelPlan
from megatron_ext.planner.cost import fp8 as F
from megatron_ext.planner.cost.compute import ComputeProfile, layer_matmul_params
from megatron_ext.planner.cost.evaluate import evaluate, plan_training
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.space import StrategyTable
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.presets import cluster_preset, model_preset
from megatron_ext.specs import FP8Spec

HYBRID = FP8Spec(format="hybrid")


def _gain(cluster: str, tokens: float, tp: int, model: str = "llama3-8b") -> float:
    bf_f, bf_b, f8_f, f8_b = F.gemm_times_s(model_preset(model), ComputeProfile(),
                                           cluster_preset(cluster), HYBRID, tokens=tokens, tp=tp)
    return float((bf_f + bf_b) / (f8_f + f8_b))


def test_small_per_rank_gemms_gain_less():
    """Not a constant 2x: large GEMMs gain most, small per-rank shards and few tokens less."""
    big, shard, few = _gain("dgx-h100", 8192, 1), _gain("dgx-h100", 8192, 8), _gain(
        "dgx-h100", 256, 8)
    assert 1.3 < big < 2.0
    assert few < shard < big
    assert few < 1.3
    assert _gain("dgx-b200", 8192, 1) == pytest.approx(big, rel=0.1)  # 2x peak on both


def _layer(cm: CostModel, strategy: LayerStrategy, mbs: int = 8):
    return cm.layer_costs(StrategyTable.of([strategy]), mbs)


def test_fp8_memory_per_recipe_and_param_gather():
    model = model_preset("llama3-8b")
    s = LayerStrategy(tp=2, sp=True, dp=4, zero=1)
    gemm_params = layer_matmul_params(model) / 2

    def state(fp8, cluster="dgx-h100"):
        cm = CostModel(model, cluster_preset(cluster), TrainingSpec(global_batch_size=8,
                                                                     seq_length=4096, fp8=fp8))
        return _layer(cm, s)

    bf16 = state(None)
    # Hopper keeps the FP8 weight and its transpose (2 B); Blackwell only the row-wise copy
    # for per-tensor recipes, both copies for mxfp8
    assert state(HYBRID).state_bytes - bf16.state_bytes == pytest.approx(2 * gemm_params)
    b200 = state(None, "dgx-b200").state_bytes
    assert state(HYBRID, "dgx-b200").state_bytes - b200 == pytest.approx(gemm_params)
    mx = FP8Spec(format="hybrid", recipe="mxfp8")
    assert state(mx, "dgx-b200").state_bytes - b200 == pytest.approx(2 * gemm_params)
    # --fp8-param-gather: no bf16 weight copy, gathered at 1 B per weight-GEMM parameter
    pg = state(dataclasses.replace(HYBRID, param_gather=True))
    assert pg.state_bytes - bf16.state_bytes == pytest.approx(0.0, abs=1.0)
    assert pg.param_gather_s < bf16.param_gather_s
    # activations: the four GEMM inputs saved in FP8, less memory but not half
    ratio = float((state(HYBRID).activation_bytes / bf16.activation_bytes)[0])
    assert 0.6 < ratio < 0.9


def test_layers_kept_in_bf16_are_priced_in_bf16():
    """The same layout with more layers kept in bf16 is slower; all layers in bf16 costs what
    a bf16 run costs."""
    model = model_preset("llama3-8b")
    plan_layers = tuple([LayerStrategy(tp=2, sp=True, dp=4, zero=1)] * model.num_layers)
    plan = ParallelPlan(world_size=8, pp=1, stages=((0, model.num_layers),), layers=plan_layers,
                        model=model, micro_batch_size=8, global_batch_size=32, seq_length=4096)

    def time(fp8):
        cm = CostModel(model, cluster_preset("dgx-h100"),
                       TrainingSpec(global_batch_size=32, seq_length=4096, fp8=fp8))
        return evaluate(cm, plan.layout).iteration_s

    tw = FP8Spec(format="hybrid", recipe="tensorwise")
    times = [time(dataclasses.replace(tw, bf16_layers=tuple(range(k)))) for k in (0, 8, 32)]
    assert times[0] < times[1] < times[2]
    assert times[2] == pytest.approx(time(None), rel=1e-9)
    # the first/last window is the same thing as the equivalent bf16_layers set
    window = dataclasses.replace(tw, first_last_layers_bf16=True, num_layers_at_start_in_bf16=4,
                                 num_layers_at_end_in_bf16=4)
    assert time(window) == pytest.approx(
        time(dataclasses.replace(tw, bf16_layers=(0, 1, 2, 3, 28, 29, 30, 31))), rel=1e-12)


def test_fp8_on_a_gpu_without_it_is_refused_before_pricing():
    with pytest.raises(PlanError, match="'mxfp8' is not supported by the GPUs of cluster "
                                        "'dgx-h100'"):
        CostModel(model_preset("llama3-8b"), cluster_preset("dgx-h100"),
                  TrainingSpec(global_batch_size=8, seq_length=4096,
                               fp8=FP8Spec(format="hybrid", recipe="mxfp8")))


def test_search_fp8_hybrid_on_h100_prices_fp8_and_writes_fp8_flags(tmp_path, capsys):
    """Done-when of the FP8 issue: the search prices FP8 (faster than the bf16 search of the
    same case, by the cost model's own FP8 numbers) and writes FP8 flags."""
    common = ["search", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch-size",
              "32", "--seq-length", "4096", "--uniform"]
    assert main(common + ["--out", str(tmp_path / "bf16.json")]) == 0
    capsys.readouterr()
    assert main(common + ["--fp8-format", "hybrid", "--out", str(tmp_path / "fp8.json")]) == 0
    argv = capsys.readouterr().out.split("\n")
    assert argv[argv.index("--fp8-format") + 1] == "hybrid"
    assert argv[argv.index("--fp8-recipe") + 1] == "delayed"
    plan = ParallelPlan.load(tmp_path / "fp8.json")
    bf16 = ParallelPlan.load(tmp_path / "bf16.json")
    assert plan.fp8 == HYBRID and bf16.fp8 is None
    assert json.loads((tmp_path / "fp8.json").read_text())["fp8"]["format"] == "hybrid"
    assert plan.prediction.iteration_time_s < bf16.prediction.iteration_time_s
    # the prediction is the FP8 evaluation of its layout, not the bf16 one
    cm = CostModel(plan.model, plan.cluster, plan_training(plan))  # with its overlap flags
    assert evaluate(cm, plan.layout).iteration_s == pytest.approx(
        plan.prediction.iteration_time_s, rel=1e-9)
    assert evaluate(cm.without_fp8(), plan.layout).iteration_s > plan.prediction.iteration_time_s
    # per-layer override from the search command; the search never changes it
    assert main(common[:-1] + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
                               "--fp8-bf16-layers", "0,31",
                               "--out", str(tmp_path / "bf.json")]) == 0
    assert ParallelPlan.load(tmp_path / "bf.json").fp8.bf16_layers == (0, 31)
    capsys.readouterr()
    assert main(common + ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'mxfp8' is not supported by the GPUs of cluster 'dgx-h100'" in err[0]


def test_fp8_kinds_in_the_layerwise_search_match_evaluate():
    """The layerwise DP prices FP8 and bf16 layers as separate kinds; its plan's prediction is
    the exact evaluation (the search's own check), with the bf16 window where the user put it."""
    from megatron_ext.planner.search import SearchOptions, search

    model = model_preset("llama3-8b")
    fp8 = FP8Spec(format="hybrid", recipe="tensorwise", first_last_layers_bf16=True)
    cm = CostModel(model, cluster_preset("dgx-h100"),
                   TrainingSpec(global_batch_size=16, seq_length=4096, fp8=fp8,
                                allow_zero3=False, allow_ulysses=False))
    result = search(cm, options=SearchOptions(explain_infeasible=False))
    plan = result.plan
    assert plan.fp8 == fp8
    assert evaluate(cm, plan.layout).iteration_s == pytest.approx(
        plan.prediction.iteration_time_s, rel=1e-9)
    assert np.isfinite(plan.prediction.iteration_time_s)


def test_fp8_moe_layer_prices_its_expert_gemms_in_fp8():
    """An FP8 MoE layer's routed experts (grouped GEMM: one GEMM per local expert at its own
    token count), shared experts and attention projections run at the FP8 GEMM model; the
    difference from the bf16 layer is exactly those GEMMs' FP8 - bf16 time, and it grows with
    the tokens per expert (few tokens per expert gain little or lose to the quantisation)."""
    from megatron_ext.planner.cost.moe import moe_layer_costs

    model = model_preset("qwen2-57b-a14b")  # 64 experts, top-8, shared expert
    s = LayerStrategy(tp=2, sp=True, dp=8, ep=8, etp=1, zero=1)
    table = StrategyTable.of([s])

    # host floor off: each pass is then its GPU time, and the FP8 saving adds up exactly
    no_host = ComputeProfile(host_kernel_s=0.0, host_collective_step_s=0.0,
                             host_microbatch_s=0.0)

    def costs(fp8, mbs, cluster="dgx-h100"):
        cm = CostModel(model, cluster_preset(cluster, num_nodes=2),
                       TrainingSpec(global_batch_size=64, seq_length=4096, fp8=fp8,
                                    moe_imbalance=1.0), compute=no_host)
        return cm, moe_layer_costs(cm, table, mbs)

    cm, f8 = costs(HYBRID, 8)
    _, bf = costs(None, 8)
    # the shapes moe_layer_costs prices: b = 1 sample per replica, rows = b s tokens per rank
    # (no CP), T = rows / tp after the SP split, recv = T k rows for the 8 local experts
    moe, h = model.moe, model.hidden_size
    b, seq = 8 / 8, 4096
    rows = b * seq
    recv = rows / 2 * moe.router_topk  # tokens after the SP split, top-k, rho 1
    local = moe.num_experts / 8
    per_expert = 1 * recv / local
    f, u = moe.expert_ffn_hidden_size(model), 2
    e = F.shapes_times_s(cm.compute, cm.cluster, HYBRID,
                         [(per_expert, h, u * f), (per_expert, f, h)], count=local)
    assert e[2] < e[0] and e[3] < e[1]  # the grouped expert GEMMs gain at this size
    d_f, d_b = F.moe_fp8_delta_s(cm, table, rows=rows, per_expert=per_expert, local=local)
    assert d_f < 0 and d_b < 0
    assert float(f8.forward_s[0] - bf.forward_s[0]) == pytest.approx(float(d_f[0]), rel=1e-9)
    assert float(f8.backward_s[0] - bf.backward_s[0]) == pytest.approx(float(d_b[0]),
                                                                        rel=1e-9)
    # the routed experts are a real share of the saving (here 44%; the shared expert and the
    # attention projections the rest), and few tokens per expert gain less
    assert (e[2] - e[0]) < 0.25 * float(d_f[0])

    def gain(rows_per_expert: float) -> float:
        g = F.shapes_times_s(cm.compute, cm.cluster, HYBRID, [(rows_per_expert, h, u * f),
                                                              (rows_per_expert, f, h)])
        return float((g[0] + g[1]) / (g[2] + g[3]))

    assert gain(per_expert / 32) < gain(per_expert) < gain(per_expert * 8)
    # a layer kept in bf16 stays bf16-priced (kinds MOE + BF16 use the model without FP8)
    bf16_kept = moe_layer_costs(cm.without_fp8(), table, 8)
    assert float(bf16_kept.forward_s[0]) == pytest.approx(float(bf.forward_s[0]))
