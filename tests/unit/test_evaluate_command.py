"""`megatron-ext evaluate` and `plan-from-args --evaluate`: the per-stage parts add up to the
cost model's score, the JSON carries them, --against-search shows the searched plan beside, and
bad input is one line with exit 2 (a plan that does not fit: the report, then exit 3)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from megatron_ext.cli import main
from megatron_ext.errors import PlanError
from megatron_ext.flags.emit import plan_to_megatron_args
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.cost.breakdown import MEMORY_PARTS, breakdown
from megatron_ext.planner.cost.compute import ComputeProfile
from megatron_ext.planner.cost.evaluate import plan_training
from megatron_ext.planner.cost.memory import state_bytes_breakdown, state_bytes_per_param
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.space import StrategyTable
from megatron_ext.planner.training import BF16_OPTIMIZER_ACCUMULATE_BYTES, TrainingSpec
from megatron_ext.presets import cluster_preset

HETERO = "examples/plans/llama2-7b_hetero_pp2.json"  # 3 strategies, recompute, pp=2
PLANS = [
    HETERO,
    "examples/plans/llama2-13b_tp4_pp2_block_recompute.json",
    "examples/plans/llama3-8b_ulysses4_cp2_zero3.json",
    "examples/plans/gpt3-1.3b_tp2_pp4_layout.json",
]


def _cost_model(plan: ParallelPlan) -> CostModel:
    cluster = plan.cluster or cluster_preset(
        "dgx-a100-80g", num_nodes=max(1, plan.world_size // 8)
    )
    training = TrainingSpec(
        global_batch_size=plan.global_batch_size,
        seq_length=plan.seq_length,
        precision=plan.precision,
    )
    return CostModel(plan.model, cluster, training)


@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_state_parts_sum_to_the_memory_model(zero, half):
    for d in (1, 2, 8):
        for states in (0, 2):
            kw = {"half_precision": half, "num_optimizer_states": states}
            parts = state_bytes_breakdown(zero, d, **kw)
            assert min(parts) >= 0
            assert sum(parts) == pytest.approx(state_bytes_per_param(zero, d, **kw), rel=1e-12)


@pytest.mark.parametrize("path", PLANS)
def test_parts_add_up_to_the_score(path):
    """Memory parts sum to evaluate's per-stage peak; on every stage compute + exposed
    communication + optimizer + bubble is the iteration time (rel 1e-9: float sums)."""
    plan = ParallelPlan.load(path)
    assert plan.world_size % 8 == 0  # the A100 preset has whole 8-GPU nodes
    cm = _cost_model(plan)
    b = breakdown(cm, plan.layout)
    ev = b.evaluation
    for k, stage in enumerate(b.stages):
        assert set(stage.memory_bytes) == set(MEMORY_PARTS)
        assert all(v >= 0 for v in stage.memory_bytes.values())
        assert stage.peak_bytes == pytest.approx(ev.stage_peak_bytes[k], rel=1e-9)
        t = stage.time_s
        total = t["compute"] + t["exposed_comm"] + t["optimizer"] + t["bubble"]
        assert total == pytest.approx(ev.iteration_s, rel=1e-9)
        assert 0 <= t["recompute"] <= t["compute"]
    slots = [s.slot_s for s in b.stages]
    assert b.bottleneck_stage == slots.index(max(slots))


def test_evaluate_json_and_against_search(tmp_path, capsys):
    out = tmp_path / "ev.json"
    assert main(["evaluate", HETERO, "--against-search", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "bottleneck:" in err and "plan vs searched" in err
    data = json.loads(out.read_text())
    mine, found = data["evaluation"], data["search"]
    plan = ParallelPlan.load(HETERO)
    assert len(mine["stages"]) == plan.pp and mine["fits"]
    assert mine["tokens_per_s"] == pytest.approx(
        plan.global_batch_size * plan.seq_length / mine["iteration_s"]
    )
    for stage in mine["stages"]:
        assert set(stage["memory_gib"]) == set(MEMORY_PARTS) | {"reserve"}
        assert stage["peak_gib"] <= mine["memory_cap_gib"]
    searched = ParallelPlan.from_dict(found["plan"])  # a valid plan on the same inputs
    assert searched.global_batch_size == plan.global_batch_size
    assert searched.seq_length == plan.seq_length and searched.model == plan.model
    assert math.isfinite(found["iteration_s"]) and found["fits"]


def test_plan_that_does_not_fit_reports_then_exits_3(capsys):
    assert main(["evaluate", HETERO, "--memory-gib", "20", "--json", "-"]) == 3
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.err
    data = json.loads(captured.out)["evaluation"]
    assert not data["fits"] and data["bottleneck"].startswith("memory: stage")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nodes", "3"], "--nodes=3 x 8 GPUs = 24 but the plan has world_size=8"),
        (["--nodes", "0"], "--nodes=0 must be >= 1"),
        (["--memory-gib", "-1"], "--memory-gib=-1.0 must be > 0"),
        (["--cluster", "nope"], "--cluster='nope' is not a preset"),
        (["--cluster-profile", "/nonexistent.json"], "/nonexistent.json"),
    ],
)
def test_bad_input_is_one_line(argv, needle, capsys):
    assert main(["evaluate", HETERO, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err, err


def test_plan_without_cluster_needs_one(tmp_path, capsys):
    data = json.loads(open(HETERO, encoding="utf-8").read())
    data["cluster"] = None
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert main(["evaluate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--cluster PRESET" in err
    assert main(["evaluate", str(path), "--cluster", "dgx-h100"]) == 0


def test_plan_from_args_evaluate(tmp_path, capsys):
    """The plan a Megatron command line describes is scored the same way as its file."""
    uniform = ParallelPlan.load("examples/plans/llama2-7b_uniform_tp2_pp2.json")
    argv = list(plan_to_megatron_args(uniform).argv)
    direct = tmp_path / "direct.json"
    assert main(["evaluate", "examples/plans/llama2-7b_uniform_tp2_pp2.json",
                 "--json", str(direct)]) == 0
    via = tmp_path / "via.json"
    assert main(["plan-from-args", "--world-size", str(uniform.world_size), "--evaluate",
                 "--cluster", "dgx-h100", "--out", str(tmp_path / "p.json"), "--json", str(via),
                 "--", *argv]) == 0
    a = json.loads(direct.read_text())["evaluation"]
    b = json.loads(via.read_text())["evaluation"]
    assert b["iteration_s"] == pytest.approx(a["iteration_s"], rel=1e-12)
    capsys.readouterr()
    # evaluate flags without --evaluate are refused, not ignored
    assert main(["plan-from-args", "--world-size", "8", "--cluster", "dgx-h100", "--",
                 *argv]) == 2
    assert "--cluster is an option of --evaluate" in capsys.readouterr().err
    for flag in (["--no-flash-attention"], ["--no-dropout"], ["--engine", "deepspeed"]):
        assert main(["plan-from-args", "--world-size", "8", *flag, "--", *argv]) == 2
        assert f"{flag[0]} is an option of --evaluate" in capsys.readouterr().err


def test_plan_from_args_prices_megatrons_overlapped_pipeline_messages(tmp_path, capsys):
    """A Megatron-LM launch with an interleaved pipeline overlaps its messages (Megatron-LM's
    default overlap_p2p_comm): plan-from-args --evaluate scores it as evaluate
    --megatron-p2p-overlap does, and --no-overlap-p2p-communication as plain evaluate (the
    messages on the critical path). rel 1e-12: the same evaluation."""
    argv = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16",
            "--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size",
            "50304", "--micro-batch-size", "1", "--global-batch-size", "32", "--bf16",
            "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
            "--num-layers-per-virtual-pipeline-stage", "2"]

    def via_flags(*extra: str) -> float:
        out = tmp_path / "via.json"
        assert main(["plan-from-args", "--world-size", "32", "--evaluate", "--cluster",
                     "dgx-h100", "--nodes", "4", "--out", str(tmp_path / "p.json"), "--json",
                     str(out), "--", *argv, *extra]) == 0
        return json.loads(out.read_text())["evaluation"]["iteration_s"]

    def direct(*flags: str) -> float:
        out = tmp_path / "direct.json"
        assert main(["evaluate", str(tmp_path / "p.json"), "--cluster", "dgx-h100", "--nodes",
                     "4", "--json", str(out), *flags]) == 0
        return json.loads(out.read_text())["evaluation"]["iteration_s"]

    overlapped = via_flags()
    assert ParallelPlan.load(str(tmp_path / "p.json")).virtual_stages == 2
    assert overlapped == pytest.approx(direct("--megatron-p2p-overlap"), rel=1e-12)
    waited = via_flags("--no-overlap-p2p-communication")
    assert waited == pytest.approx(direct(), rel=1e-12)
    assert overlapped < waited
    capsys.readouterr()


def test_deepspeed_bf16_engine_all_reduces_and_keeps_the_bf16_grads(tmp_path, capsys):
    """--engine deepspeed-bf16 (DeepSpeed's BF16_Optimizer): a ZeRO-1 plan's gradient
    reduction is a bf16 all-reduce (2 bytes per gradient), not ZeRO-1's fp32 reduce-scatter: as
    many bytes on the wire, twice the ring steps; its weight all-gather stays; each parameter
    keeps a bf16 .grad (2 bytes) more than ZeRO-1, folded into the fp32 buffer after every
    micro-batch's backward. rel 1e-12: the same sums (1e-9 where a difference of sums)."""
    plan = ParallelPlan.load("examples/plans/llama2-7b_uniform_tp2_pp2.json")
    assert plan.precision == "bf16" and {s.dp for s in plan.layers} == {2}
    cluster = cluster_preset("dgx-a100-80g", num_nodes=1)
    layer = dataclasses.replace(plan.layers[0], zero=1)
    table = StrategyTable.of([layer])

    def model(engine: str) -> CostModel:  # host floor off: a pass takes its GPU time
        no_host = ComputeProfile(host_kernel_s=0.0, host_collective_step_s=0.0,
                                 host_microbatch_s=0.0)
        return CostModel(plan.model, cluster, plan_training(plan, engine=engine),
                         compute=no_host)

    bf16 = model("deepspeed-bf16").layer_costs(table, plan.micro_batch_size)
    zero1 = model("deepspeed").layer_costs(table, plan.micro_batch_size)
    params = model("deepspeed").layer_params / layer.tp
    expected = model("deepspeed").bucketed_s("all_reduce", params, 2, table.shard_ranks, table.tp)
    assert bf16.grad_sync_s[0] == pytest.approx(expected[0], rel=1e-12)
    assert bf16.grad_sync_s[0] >= zero1.grad_sync_s[0]  # the same bytes, more ring steps
    assert bf16.param_gather_s[0] == pytest.approx(zero1.param_gather_s[0], rel=1e-12)
    extra = bf16.state_bytes[0] - zero1.state_bytes[0]
    assert extra == pytest.approx(2.0 * params, rel=1e-12)
    # after every micro-batch's backward it folds the bf16 grads into its fp32 buffer
    hbm = model("deepspeed").compute.hbm_for(cluster)
    assert bf16.backward_s[0] - zero1.backward_s[0] == pytest.approx(
        BF16_OPTIMIZER_ACCUMULATE_BYTES * params / hbm, rel=1e-9)
    assert bf16.forward_s[0] == zero1.forward_s[0]
    for d in (1, 2, 8):
        parts = state_bytes_breakdown(1, d, half_precision=True, half_grads=True)
        assert sum(parts) == pytest.approx(
            state_bytes_per_param(1, d, half_precision=True, half_grads=True), rel=1e-12)
    # the command takes it; refusals are one line, exit 2
    out = tmp_path / "e.json"
    assert main(["evaluate", "examples/plans/llama2-7b_uniform_tp2_pp2.json", "--engine",
                 "deepspeed-bf16", "--json", str(out)]) == 0
    capsys.readouterr()
    assert main(["evaluate", "examples/plans/llama3-8b_ulysses4_cp2_zero3.json", "--engine",
                 "deepspeed-bf16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "zero=3" in err[0] and "--engine deepspeed" in err[0], err
    with pytest.raises(PlanError, match="precision is fp16: use --engine deepspeed"):
        TrainingSpec(global_batch_size=8, seq_length=128, precision="fp16",
                     engine="deepspeed-bf16")
