"""FP8 in the plan file and Megatron-LM's FP8 flags both ways: the plan field, which layers run
FP8 (Megatron-LM's first/last window plus megatron_ext's per-layer override), the one-line
refusals, and the corpus' FP8 configs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.flags.emit import plan_to_megatron_args
from megatron_ext.flags.parser import parse_megatron_args, plan_from_megatron_args
from megatron_ext.plan import ParallelPlan
from megatron_ext.presets import cluster_preset
from megatron_ext.specs import FP8Spec

MEGATRON = Path(__file__).resolve().parents[1] / "data" / "megatron_lm"
BASE = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
        "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
        "--vocab-size", "1024", "--bf16", "--tensor-model-parallel-size", "2",
        "--use-distributed-optimizer"]


def _plan(extra: list[str], world: int = 4) -> ParallelPlan:
    ns = parse_megatron_args(BASE + extra, world_size=world)
    return plan_from_megatron_args(ns, world)


def test_fp8_flags_reach_the_plan_and_come_back():
    flags = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather",
             "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2",
             "--num-layers-at-end-in-bf16", "0"]
    plan = _plan(flags)
    assert plan.fp8 == FP8Spec(format="hybrid", recipe="tensorwise", param_gather=True,
                               first_last_layers_bf16=True, num_layers_at_start_in_bf16=2,
                               num_layers_at_end_in_bf16=0)
    assert plan.fp8.fp8_layers(8) == (False, False) + (True,) * 6
    argv = list(plan_to_megatron_args(plan).argv)
    for flag in flags:
        assert flag in argv
    assert _plan(argv[argv.index("--fp8-format"):]) == plan  # the FP8 flags alone read back
    again = ParallelPlan.from_dict(json.loads(plan.to_json()))
    assert again == plan


def test_delayed_recipe_flags_and_defaults():
    plan = _plan(["--fp8-format", "e4m3", "--fp8-amax-history-len", "1024",
                  "--fp8-amax-compute-algo", "max", "--no-fp8-wgrad", "--fp8-margin", "1"])
    fp8 = plan.fp8
    assert (fp8.recipe, fp8.amax_history_len, fp8.amax_compute_algo, fp8.wgrad, fp8.margin) == (
        "delayed", 1024, "max", False, 1)
    assert all(fp8.fp8_layers(8))
    assert _plan([]).fp8 is None  # without --fp8-format the other FP8 flags do nothing
    assert _plan(["--fp8-recipe", "mxfp8"]).fp8 is None


def test_plans_without_fp8_keep_their_json():
    plan = _plan([])
    data = plan.to_dict()
    assert "fp8" not in data  # version-1 files unchanged; absent = no FP8
    assert ParallelPlan.from_dict(data).fp8 is None


def test_per_layer_bf16_override_is_a_plan_only_feature(tmp_path):
    plan = _plan(["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"])
    plan = dataclasses.replace(plan, fp8=dataclasses.replace(plan.fp8, bf16_layers=(3, 5)))
    assert plan.fp8.fp8_layers(8) == (True, True, True, False, True, False, True, True)
    args = plan_to_megatron_args(plan, plan_path=str(tmp_path / "p.json"))
    assert args.uses_strategy_config
    assert any("fp8.bf16_layers [3, 5]" in r for r in args.needs_megatron_ext)


@pytest.mark.parametrize("extra, message", [
    (["--fp8-format", "hybrid", "--fp8-recipe", "custom"], "--fp8-recipe custom: a recipe"),
    (["--fp8-param-gather"], "--fp8-param-gather needs --fp8-format"),
    (["--fp8-format", "hybrid", "--first-last-layers-bf16"],
     "fp8.first_last_layers_bf16 with fp8.recipe='delayed'"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--no-fp8-wgrad"],
     "fp8.wgrad=false (--no-fp8-wgrad) with fp8.recipe='tensorwise'"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16",
      "--num-layers-at-start-in-bf16", "9"], "fp8.num_layers_at_start_in_bf16=9 exceeds"),
    (["--fp4-format", "e2m1"], "--fp4-format e2m1: FP4 training"),
])
def test_bad_fp8_flags_are_one_line(extra, message):
    with pytest.raises(PlanError) as err:
        _plan(extra)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_fp8_recipe_the_gpu_lacks_and_shapes_te_refuses():
    plan = _plan(["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], world=8)
    with pytest.raises(PlanError, match=r"^fp8.recipe='mxfp8' is not supported by the GPUs of "
                                        r"cluster 'dgx-h100' .* use --fp8-recipe delayed"):
        dataclasses.replace(plan, cluster=cluster_preset("dgx-h100"))
    dataclasses.replace(plan, cluster=cluster_preset("dgx-b200"))  # Blackwell runs it
    with pytest.raises(PlanError, match="no FP8 tensor cores"):
        dataclasses.replace(plan, cluster=cluster_preset("dgx-a100-80g"))
    # hidden 264 / 8 heads: every per-rank GEMM dimension must be a multiple of 16
    odd = BASE[:3] + ["264"] + BASE[4:]
    ns = parse_megatron_args(odd + ["--fp8-format", "hybrid"], world_size=4)
    with pytest.raises(PlanError) as err:
        plan_from_megatron_args(ns, 4)
    assert "FP8 GEMM dimension hidden_size = 264 is not a multiple of 16" in str(err.value)
    assert "\n" not in str(err.value)


def test_corpus_fp8_configs_plan_with_their_recipes():
    """The Megatron-LM functional tests that train in FP8 become plans whose FP8 fields are
    the flags' (test_real_inputs checks the whole corpus and the argv round trip)."""
    expected = json.loads((MEGATRON / "expected.json").read_text())
    seen = {}
    for name in expected:
        argv = json.loads((MEGATRON / f"{name}.json").read_text())["argv"]
        if "--fp8-format" not in argv or expected[name] != "plan":
            continue
        ns = parse_megatron_args(argv, world_size=8)
        plan = plan_from_megatron_args(ns, 8, vocab_size=50257)  # as test_real_inputs does
        assert plan.fp8 is not None and plan.fp8.format == argv[argv.index("--fp8-format") + 1]
        recipe = argv[argv.index("--fp8-recipe") + 1] if "--fp8-recipe" in argv else "delayed"
        assert plan.fp8.recipe == recipe
        assert plan.fp8.param_gather == ("--fp8-param-gather" in argv)
        seen[name] = recipe
    assert len(seen) == 13  # the 12 dense FP8 tests and the MoE ep4 etp1 resume test
    assert set(seen.values()) == {"delayed", "tensorwise", "mxfp8"}
