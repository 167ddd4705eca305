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


TP_FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
            "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
            "--vocab-size", "1000", "--bf16", "--tensor-model-parallel-size", "2"]


def test_tp_comm_overlap_round_trips_through_the_plan(tmp_path):
    """plan-from-args reads --tp-comm-overlap into the plan, the plan file keeps it, `args`
    prints it and plan-from-args reads the same plan back; under --strategy-config the plan's
    value fills the flag in."""
    ns = parse_megatron_args([*TP_FLAGS, "--sequence-parallel", "--tp-comm-overlap"],
                             world_size=4)
    plan = plan_from_megatron_args(ns, 4)
    assert plan.tp_comm_overlap
    assert ParallelPlan.from_dict(json.loads(plan.to_json())) == plan
    argv = list(plan_to_megatron_args(plan).argv)
    assert argv.count("--tp-comm-overlap") == 1
    assert plan_from_megatron_args(parse_megatron_args(argv, world_size=4), 4) == plan
    plain = plan_from_megatron_args(parse_megatron_args([*TP_FLAGS, "--sequence-parallel"],
                                                        world_size=4), 4)
    assert not plain.tp_comm_overlap and "tp_comm_overlap" not in plain.to_dict()
    assert "--tp-comm-overlap" not in plan_to_megatron_args(plain).argv
    path = tmp_path / "plan.json"
    plan.save(path)
    filled = parse_megatron_args([*TP_FLAGS[:10], "--strategy-config", str(path)], world_size=4)
    assert filled.tp_comm_overlap


def test_tp_comm_overlap_needs_sequence_parallel():
    """Megatron-LM's validate_args: --tp-comm-overlap needs --sequence-parallel, which tp = 1
    turns off; one line each."""
    for extra in ([], ["--sequence-parallel", "--tensor-model-parallel-size", "1"]):
        with pytest.raises(PlanError) as err:
            parse_megatron_args([*TP_FLAGS, "--tp-comm-overlap", *extra], world_size=4)
        assert str(err.value).startswith("--tp-comm-overlap needs --sequence-parallel")
        assert "\n" not in str(err.value)


def test_training_runtime_refuses_tp_comm_overlap_as_before(tmp_path, capsys):
    """pretrain_gpt.py refuses it, from the flags or from a --strategy-config plan, with the line
    it has always printed; the search never plans it."""
    from megatron_ext.megatron_adapter.training.entry import check_supported

    line = ("--tp-comm-overlap: transformer-engine tensor-parallel communication overlap is not "
            "supported by megatron_ext; drop it")
    ns = parse_megatron_args([*TP_FLAGS, "--sequence-parallel", "--tp-comm-overlap"],
                             world_size=4)
    with pytest.raises(PlanError) as err:
        check_supported(ns)
    assert str(err.value) == line
    path = tmp_path / "plan.json"
    plan_from_megatron_args(ns, 4).save(path)
    ns = parse_megatron_args([*TP_FLAGS[:10], "--strategy-config", str(path)], world_size=4)
    with pytest.raises(PlanError) as err:
        check_supported(ns)
    assert str(err.value) == line
    assert main(["flags", "tp-comm-overlap"]) == 0
    assert capsys.readouterr().out.strip().endswith("pretrain_gpt.py refuses it: " + line)
    cm = _cm(False)
    cm = cm.with_training(dataclasses.replace(cm.training, tp_comm_overlap=True))
    with pytest.raises(PlanError, match="the search does not plan --tp-comm-overlap"):
        search(cm)


def test_evaluate_prices_tp_comm_overlap(tmp_path, capsys):
    """plan-from-args --evaluate with and without the flag: the same layout, faster with it;
    evaluate --tp-comm-overlap on a plan without SP is refused in one line."""
    flags = ["--num-layers", "8", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--seq-length", "4096", "--max-position-embeddings", "4096",
             "--micro-batch-size", "1", "--global-batch-size", "16", "--vocab-size", "32000",
             "--bf16", "--tensor-model-parallel-size", "8", "--sequence-parallel"]
    times = []
    for extra in ([], ["--tp-comm-overlap"]):
        out = tmp_path / f"eval{len(extra)}.json"
        assert main(["plan-from-args", "--world-size", "16", "--evaluate", "--cluster",
                     "dgx-h100", "--nodes", "2", "--json", str(out), "--", *flags, *extra]) == 0
        times.append(json.loads(out.read_text())["evaluation"]["iteration_s"])
    assert times[1] < times[0]
    # --against-search: the searched plan is searched and priced without the overlap
    with_flag = tmp_path / "with_flag.json"
    ns = parse_megatron_args([*flags, "--tp-comm-overlap"], world_size=16)
    plan_from_megatron_args(ns, 16).save(with_flag)
    out = tmp_path / "against.json"
    assert main(["evaluate", str(with_flag), "--cluster", "dgx-h100", "--nodes", "2",
                 "--against-search", "--json", str(out)]) == 0
    searched = ParallelPlan.from_dict(json.loads(out.read_text())["search"]["plan"])
    assert not searched.tp_comm_overlap
    plain = CostModel(searched.model, cluster_preset("dgx-h100", num_nodes=2),
                      plan_training(searched))
    assert json.loads(out.read_text())["search"]["iteration_s"] == pytest.approx(
        evaluate(plain, searched.layout).iteration_s, rel=1e-9)
    plan = tmp_path / "no_sp.json"
    ns = parse_megatron_args(TP_FLAGS, world_size=8)
    plan_from_megatron_args(ns, 8).save(plan)
    capsys.readouterr()
    assert main(["evaluate", str(plan), "--cluster", "dgx-h100", "--tp-comm-overlap"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tp_comm_overlap=true needs a layer with tp > 1 and sp=true" in err[0]
