"""`search` plans with Megatron-LM's --overlap-grad-reduce / --overlap-param-gather on (the
default) or off (`--no-overlap`): the plan records the flags, `args` prints them,
`plan-from-args` reads them back, and `evaluate` prices the plan file as the search priced it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_ext.cli import main
from megatron_ext.errors import PlanError
from megatron_ext.flags.emit import plan_to_megatron_args
from megatron_ext.flags.parser import parse_megatron_args
from megatron_ext.flags.to_plan import plan_from_megatron_args
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.cost.evaluate import evaluate, plan_training
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.search import search
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.presets import cluster_preset, model_preset

HETERO = "examples/plans/llama2-7b_hetero_pp2.json"


def _cm(overlap: bool) -> CostModel:
    """llama2-7b on 4 A100 nodes at a small global batch: the gradient reduction crosses nodes
    and is a visible part of the step, so overlapping it changes the prediction."""
    return CostModel(model_preset("llama2-7b"), cluster_preset("dgx-a100-80g", num_nodes=4),
                     TrainingSpec(global_batch_size=64, seq_length=4096, precision="bf16",
                                  overlap_grad_reduce=overlap, overlap_param_gather=overlap))


@pytest.fixture(scope="module")
def plans() -> dict[bool, ParallelPlan]:
    return {overlap: search(_cm(overlap)).plan for overlap in (True, False)}


def test_the_plan_records_what_the_search_priced(plans):
    on, off = plans[True], plans[False]
    assert on.overlap_grad_reduce and not off.overlap_grad_reduce and not off.overlap_param_gather
    # param gather only where Megatron-LM allows it: with a distributed optimizer (ZeRO-1)
    assert on.overlap_param_gather == any(s.zero == 1 for s in on.layers)
    for plan in (on, off):
        cm = CostModel(plan.model, plan.cluster, plan_training(plan))
        again = evaluate(cm, plan.layout).iteration_s
        assert again == pytest.approx(plan.prediction.iteration_time_s, rel=1e-9)
    # overlapping can only hide traffic: the best overlapped plan is never slower, and here the
    # unoverlapped reduction is visible (a cross-node reduce of 7B gradients at batch 64)
    assert on.prediction.iteration_time_s < off.prediction.iteration_time_s


def test_the_unoverlapped_plan_priced_with_overlap_is_faster(plans):
    """The same layout under the two flag settings: the flags, not the layout, make the gap."""
    off = plans[False]
    flagged = dataclasses.replace(off, overlap_grad_reduce=True,
                                  overlap_param_gather=any(s.zero == 1 for s in off.layers),
                                  prediction=None)
    times = [evaluate(CostModel(p.model, p.cluster, plan_training(p)), p.layout).iteration_s
             for p in (off, flagged)]
    assert times[1] < times[0]


def test_args_print_the_flags_and_plan_from_args_reads_them(plans):
    plan = dataclasses.replace(plans[True], prediction=None, cluster=None)
    argv = list(plan_to_megatron_args(plan, plan_path="p.json").argv)
    assert "--overlap-grad-reduce" in argv
    assert ("--overlap-param-gather" in argv) == plan.overlap_param_gather
    if "--strategy-config" not in argv:  # a uniform plan: the flags alone say it
        back = plan_from_megatron_args(parse_megatron_args(argv, world_size=plan.world_size),
                                       plan.world_size)
        assert (back.overlap_grad_reduce, back.overlap_param_gather) == (
            plan.overlap_grad_reduce, plan.overlap_param_gather)
    off = dataclasses.replace(plans[False], prediction=None, cluster=None)
    argv = list(plan_to_megatron_args(off, plan_path="p.json").argv)
    assert "--overlap-grad-reduce" not in argv and "--overlap-param-gather" not in argv


def test_plan_from_args_of_a_uniform_run(tmp_path, capsys):
    flags = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
             "--max-position-embeddings", "512", "--seq-length", "512", "--micro-batch-size", "1",
             "--global-batch-size", "8", "--vocab-size", "1024", "--bf16",
             "--use-distributed-optimizer"]
    for extra, want in (([], (False, False)), (["--overlap-grad-reduce"], (True, False)),
                        (["--overlap-grad-reduce", "--overlap-param-gather"], (True, True))):
        out = tmp_path / "p.json"
        assert main(["plan-from-args", "--world-size", "4", "--out", str(out), "--",
                     *flags, *extra]) == 0
        plan = ParallelPlan.load(out)
        assert (plan.overlap_grad_reduce, plan.overlap_param_gather) == want
        assert plan_training(plan).overlap_grad_reduce == want[0]
        emitted = plan_to_megatron_args(plan).argv
        assert [t for t in emitted if t.startswith("--overlap")] == extra


def test_search_cli_default_and_no_overlap(tmp_path, capsys):
    common = ["search", "--model", "llama2-7b", "--cluster", "dgx-a100-80g", "--nodes", "4",
              "--global-batch-size", "64", "--seq-length", "4096", "--uniform"]
    on, off = tmp_path / "on.json", tmp_path / "off.json"
    assert main([*common, "--out", str(on)]) == 0
    printed_on = capsys.readouterr().out.split()
    assert main([*common, "--no-overlap", "--out", str(off)]) == 0
    printed_off = capsys.readouterr().out.split()
    assert "--overlap-grad-reduce" in printed_on and "--overlap-grad-reduce" not in printed_off
    assert json.loads(on.read_text())["overlap_grad_reduce"] is True
    assert "overlap_grad_reduce" not in json.loads(off.read_text())  # Megatron-LM's default


def test_plan_file_refuses_what_megatron_refuses():
    data = json.loads(open(HETERO).read())  # layers 0-17 ZeRO-1
    data["overlap_param_gather"] = True
    with pytest.raises(PlanError, match="overlap_param_gather=true needs overlap_grad_reduce"):
        ParallelPlan.from_dict(data)
    data["overlap_grad_reduce"] = True
    assert ParallelPlan.from_dict(data).overlap_param_gather
    no_zero = dict(data, layers=[dict(r, zero=0) for r in data["layers"]])
    with pytest.raises(PlanError, match="needs a ZeRO-1 layer"):
        ParallelPlan.from_dict(no_zero)
    data["overlap_grad_reduce"] = "yes"
    with pytest.raises(PlanError, match="overlap_grad_reduce"):
        ParallelPlan.from_dict(data)


def test_strategy_config_plan_fills_the_flags(tmp_path):
    """A layerwise plan's overlap flags reach the run through --strategy-config; per-layer ZeRO
    with a ZeRO-1 layer is a distributed optimizer for --overlap-param-gather."""
    plan = ParallelPlan.load(HETERO)
    layers = tuple(dataclasses.replace(s, zero=1 if i % 2 else 0)
                   for i, s in enumerate(plan.layers))
    plan = dataclasses.replace(plan, layers=layers, overlap_grad_reduce=True,
                               overlap_param_gather=True, prediction=None)
    path = tmp_path / "plan.json"
    plan.save(path)
    argv = list(plan_to_megatron_args(plan, plan_path=str(path)).argv)
    assert "--strategy-config" in argv and "--overlap-param-gather" in argv
    ns = parse_megatron_args(argv, world_size=plan.world_size)
    assert ns.overlap_grad_reduce and ns.overlap_param_gather
    # the flags left out: the plan's fill them in
    bare = [t for t in argv if not t.startswith("--overlap")]
    ns = parse_megatron_args(bare, world_size=plan.world_size)
    assert ns.overlap_grad_reduce and ns.overlap_param_gather
