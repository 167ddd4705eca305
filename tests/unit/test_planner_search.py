"""End-to-end search: emitted plans validate, more memory never hurts, uniform results round-trip
through Megatron flags, infeasible inputs name what would fit, and the CLI's exit codes."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from megatron_ext.cli import main
from megatron_ext.errors import InfeasiblePlanError
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.cost.compute import model_parameters
from megatron_ext.planner.cost.evaluate import evaluate
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.infeasible import min_memory_gib
from megatron_ext.planner.search import SearchOptions, search
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.presets import cluster_preset, model_file_with_notes, model_preset


def cost_model(
    memory_gib: float,
    *,
    model: str = "llama2-7b",
    nodes: int = 1,
    gbs: int = 64,
    seq: int = 2048,
    **training,
) -> CostModel:
    return CostModel(
        model_preset(model),
        cluster_preset("dgx-a100-80g", num_nodes=nodes, memory_gib=memory_gib),
        TrainingSpec(global_batch_size=gbs, seq_length=seq, **training),
    )


def check_emitted(result, cm: CostModel) -> None:
    """The plan validates (construction ran check_plan), survives JSON, and its prediction is
    the exact evaluation of its layout, within memory."""
    plan = result.plan
    again = ParallelPlan.from_dict(json.loads(plan.to_json()))
    assert again == plan
    assert plan.prediction is not None and plan.cluster == cm.cluster
    ev = evaluate(
        cm,
        plan.layout,
    )
    assert ev.feasible
    assert ev.iteration_s == pytest.approx(plan.prediction.iteration_time_s, rel=1e-12)
    assert plan.prediction.tokens_per_s == pytest.approx(
        plan.global_batch_size * plan.seq_length / ev.iteration_s
    )
    if result.uniform_evaluation is not None:
        assert result.evaluation.iteration_s <= result.uniform_evaluation.iteration_s
        assert result.uniform_plan.is_uniform()


def test_more_memory_is_never_worse():
    """Memory from tight (recompute, sharding) to ample; every emitted plan checked."""
    previous = None
    for memory in (17, 20, 24, 32, 48, 80):
        cm = cost_model(memory)
        result = search(cm)
        check_emitted(result, cm)
        if previous is not None:
            assert result.evaluation.iteration_s <= previous * (1 + 1e-12)
        previous = result.evaluation.iteration_s


def test_layerwise_beats_uniform_when_memory_is_tight():
    """At 20 GiB the uniform baseline must shard 4-way with TP (or recompute everything); the
    layerwise plan shards only the layers that need it (ZeRO-3 or recompute on some layers), so
    it is strictly faster with a layout Megatron-LM flags cannot express."""
    cm = cost_model(20)
    result = search(cm)
    assert result.evaluation.iteration_s < 0.97 * result.uniform_evaluation.iteration_s
    assert not result.plan.is_uniform()


def test_vocab_parallel_flag_is_honoured():
    cm = cost_model(80, model="llama3-8b", nodes=2, gbs=64, seq=4096, allow_vocab_parallel=False)
    result = search(cm)
    check_emitted(result, cm)
    assert result.plan.vocab.mode == "tp"


def test_uniform_search_round_trips_through_megatron_flags():
    # megatron-core is a required dependency: a failing import is a failure, not a skip
    from megatron_ext.flags import emit as args_module
    from megatron_ext.flags import parser as arguments
    cm = cost_model(24)
    result = search(cm, options=SearchOptions(uniform_only=True))
    plan = result.plan
    assert plan.is_uniform()
    out = args_module.plan_to_megatron_args(plan)
    assert not out.uses_strategy_config and not out.needs_megatron_ext
    ns = arguments.parse_megatron_args(list(out.argv), world_size=plan.world_size)
    back = arguments.plan_from_megatron_args(ns, plan.world_size)
    for name in (
        "pp",
        "virtual_stages",
        "stages",
        "layers",
        "micro_batch_size",
        "global_batch_size",
        "seq_length",
        "vocab",
        "precision",
    ):
        assert getattr(back, name) == getattr(plan, name), name


def test_infeasible_names_memory_and_gpus_that_fit():
    cm = cost_model(12)
    with pytest.raises(InfeasiblePlanError) as err:
        search(cm)
    message = str(err.value)
    assert "GiB per GPU" in message and "--nodes" in message
    need = min_memory_gib(cm)
    fits = dataclasses.replace(cm.cluster, memory_gib=need * 1.03)
    search(CostModel(cm.model, fits, cm.training))  # the suggestion really fits


@pytest.mark.parametrize(("model", "memory_gib", "gbs", "seq"), [
    ("DeepSeek-V3", 80, 512, 4096),  # 671B, 58 of 61 layers MoE
    ("llama2-13b", 8, 16, 2048),  # dense
])
def test_node_hint_holds_the_states_and_the_search_fits_there(model, memory_gib, gbs, seq):
    """The GPU count an infeasible search suggests holds the model's weights, gradients and Adam
    states (16 B per parameter at the least: fp32 weight, fp32 gradient, two fp32 moments) in
    the memory left after the reserve, the search finds a layout there, and not one node less.
    DeepSeek-V3 on 8 x 80 GiB once got "16 GPUs (--nodes 2)": 1.3 TB for 10.7 TB of states."""
    if model == "DeepSeek-V3":
        path = Path(__file__).parents[1] / "data" / "hf_configs" / "DeepSeek-V3.json"
        spec = model_file_with_notes(path)[0]
        cluster = cluster_preset("dgx-h100", memory_gib=memory_gib)
    else:
        spec = model_preset(model)
        cluster = cluster_preset("dgx-a100-80g", memory_gib=memory_gib)
    cm = CostModel(spec, cluster, TrainingSpec(global_batch_size=gbs, seq_length=seq))
    with pytest.raises(InfeasiblePlanError) as err:
        search(cm)
    found = re.search(r"it needs .*?(\d+) GPUs \(--nodes (\d+)\)$", str(err.value))
    assert found, str(err.value)
    gpus, nodes = int(found[1]), int(found[2])
    assert gpus == nodes * cluster.gpus_per_node
    usable = (memory_gib - (1 + 0.04 * memory_gib)) * 2**30  # TrainingSpec's default reserve
    assert gpus * usable >= 16 * model_parameters(spec)
    options = SearchOptions(explain_infeasible=False)
    search(cm.with_cluster(dataclasses.replace(cluster, num_nodes=nodes)), options=options)
    if nodes - 1 > cluster.num_nodes:
        with pytest.raises(InfeasiblePlanError):
            search(cm.with_cluster(dataclasses.replace(cluster, num_nodes=nodes - 1)),
                   options=options)


def test_cli_default_case_writes_plan_and_flags(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["search", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "predicted: iteration" in captured.err
    assert ParallelPlan.load(out).model.name == "llama2-7b"
    if "--tensor-model-parallel-size" not in captured.out:
        assert "note:" in captured.err


def test_cli_exit_codes(capsys):
    assert main(["search", "--global-batch-size", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--global-batch-size" in err
    assert (
        main(
            [
                "search",
                "--model",
                "llama2-13b",
                "--memory-gib",
                "8",
                "--global-batch-size",
                "16",
                "--seq-length",
                "2048",
            ]
        )
        == 3
    )
    assert "GiB per GPU" in capsys.readouterr().err


def test_cli_model_config_files(tmp_path, capsys):
    """--model-config reads a HuggingFace config.json and a file of Megatron-LM model flags."""
    hf = tmp_path / "config.json"
    hf.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 8,
                "hidden_size": 1024,
                "intermediate_size": 2816,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "vocab_size": 32000,
                "hidden_act": "silu",
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 4096,
            }
        )
    )
    flags = tmp_path / "small.args"
    flags.write_text(
        "--num-layers 8 --hidden-size 1024 --ffn-hidden-size 2816\n"
        "--num-attention-heads 16 --group-query-attention --num-query-groups 4\n"
        "--swiglu --normalization RMSNorm --position-embedding-type rope\n"
        "--max-position-embeddings 4096 --untie-embeddings-and-output-weights\n"
        "--disable-bias-linear --vocab-size 32000\n"
    )
    plans = []
    for path in (hf, flags):
        out = tmp_path / f"{path.stem}.plan.json"
        assert (
            main(
                [
                    "search",
                    "--model-config",
                    str(path),
                    "--global-batch-size",
                    "16",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        plans.append(ParallelPlan.load(out))
    capsys.readouterr()
    same = ("num_layers", "hidden_size", "ffn_hidden_size", "num_query_groups", "vocab_size")
    for name in same:
        assert getattr(plans[0].model, name) == getattr(plans[1].model, name)
    assert plans[0].layers == plans[1].layers


def test_cli_uses_a_cluster_profile(tmp_path, capsys):
    """--cluster-profile reads the hardware profiler's file; --nodes and --memory-gib override
    its cluster."""
    from megatron_ext.planner.profile.profiles import ClusterProfile, CollectiveCurve

    curve = CollectiveCurve(
        collective="all_reduce",
        group_size=8,
        stride=1,
        ranks_per_node=8,
        num_bytes=(1e6, 1e7, 1e8),
        seconds=(1e-4, 1e-3, 1e-2),
    )
    path = tmp_path / "cluster.json"
    ClusterProfile(
        cluster=cluster_preset("dgx-h100"),
        backend="nccl",
        device="test",
        overlap_slowdown=1.2,
        collectives=(curve,),
    ).save(path)
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "search",
                "--cluster-profile",
                str(path),
                "--nodes",
                "2",
                "--memory-gib",
                "60",
                "--global-batch-size",
                "32",
                "--seq-length",
                "2048",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    capsys.readouterr()
    plan = ParallelPlan.load(out)
    assert plan.world_size == 16 and plan.cluster.memory_gib == 60


def test_default_space_holds_interleaving():
    """llama2-7b on 8 GPUs with 24 GiB: the best uniform layout is interleaved
    (--num-layers-per-virtual-pipeline-stage), the search's plan is never slower than it, and
    leaving interleaving out never gives a faster plan (the space only grows)."""
    cm = cost_model(24)
    result = search(cm)
    assert result.uniform_plan.virtual_stages > 1
    assert result.evaluation.iteration_s <= result.uniform_evaluation.iteration_s
    assert any(p.virtual_stages > 1 for p in result.candidates)
    check_emitted(result, cm)
    without = search(cost_model(24, allow_interleaving=False))
    assert all(p.virtual_stages == 1 for p in without.candidates)
    assert result.evaluation.iteration_s <= without.evaluation.iteration_s * (1 + 1e-12)


def test_vocabulary_tp_divides_the_heads() -> None:
    # the vocabulary layers are built from megatron-core's TransformerConfig at their tp
    from megatron_ext.planner.space import vocab_options
    model = dataclasses.replace(model_preset("tiny-llama"), num_attention_heads=1,
                                num_query_groups=1)
    t = TrainingSpec(global_batch_size=8, seq_length=32)
    options = vocab_options(model, width=4, pp=2, nvlink_gpus=8, training=t, micro_batch_size=8)
    assert options and {v.tp for v in options} == {1}
