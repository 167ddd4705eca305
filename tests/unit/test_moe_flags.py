"""Megatron-LM's MoE flags <-> the plan: parsing (--moe-layer-freq patterns included), Megatron-LM's
MoE rules as one-line errors, `megatron-ext args` for uniform MoE plans, --strategy-config
consistency, and the training-only MoE flags the training run reads from the namespace."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.flags.emit import plan_to_megatron_args
from megatron_ext.flags.moe import layer_freq_text, moe_freq_type
from megatron_ext.flags.parser import parse_megatron_args, plan_from_megatron_args
from megatron_ext.plan import LayerStrategy, ParallelPlan
from megatron_ext.specs import ModelSpec, MoESpec

BASE = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", "4", "--max-position-embeddings", "64", "--seq-length", "32",
        "--micro-batch-size", "1", "--vocab-size", "512", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
MIXTRAL = Path(__file__).resolve().parents[1] / "data" / "megatron_lm" / "examples" / \
    "train_mixtral_8x7b_distributed.json"


def _plan(argv: list[str], world: int) -> ParallelPlan:
    return plan_from_megatron_args(parse_megatron_args(argv, world_size=world), world)


def _round_trip(plan: ParallelPlan) -> list[str]:
    argv = list(plan_to_megatron_args(plan).argv)
    assert "--strategy-config" not in argv
    assert _plan(argv, plan.world_size) == plan
    return argv


@pytest.mark.parametrize(("text", "expected"), [
    ("2", 2),
    ("([0]*3+[1]*5)", [0, 0, 0, 1, 1, 1, 1, 1]),
    ("([1]*3+[0]*2)*2", [1, 1, 1, 0, 0, 1, 1, 1, 0, 0]),
    ("[0,1,1]", [0, 1, 1]),
])
def test_layer_freq_patterns_as_megatron(text: str, expected: object) -> None:
    assert moe_freq_type(text) == expected
    if isinstance(expected, list):
        assert moe_freq_type(layer_freq_text(expected)) == expected


@pytest.mark.parametrize("text", ["__import__('os')", "([0]*3", "[0]*10**9", "(1+2)"])
def test_layer_freq_patterns_refused(text: str) -> None:
    with pytest.raises(PlanError, match="--moe-layer-freq") as err:
        parse_megatron_args([*BASE, *MOE, "--moe-layer-freq", text])
    assert "\n" not in str(err.value)


def test_mixtral_script_flags_read_into_a_plan_and_back() -> None:
    """Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh on its 64 GPUs, with
    NullTokenizer in place of Llama2Tokenizer (which megatron_ext refuses)."""
    argv = json.loads(MIXTRAL.read_text())["argv"]
    argv[argv.index("Llama2Tokenizer")] = "NullTokenizer"
    ns = parse_megatron_args([*argv, "--vocab-size", "32000"], world_size=64)
    assert (ns.moe_token_dispatcher_type, ns.moe_grouped_gemm) == ("alltoall", True)
    plan = plan_from_megatron_args(ns, 64)
    moe = plan.model.moe
    assert moe is not None and (moe.num_experts, moe.router_topk, moe.aux_loss_coeff) == (
        8, 2, 0.01)
    assert moe.layer_freq == 1 and moe.expert_ffn_hidden_size(plan.model) == 14336
    assert {(s.tp, s.dp, s.ep, s.expert_tp, s.expert_dp) for s in plan.layers} == {
        (1, 16, 8, 1, 2)}
    argv = _round_trip(plan)
    assert " ".join(argv).count("--num-experts 8 --moe-router-topk 2 "
                                "--moe-router-load-balancing-type aux_loss "
                                "--moe-aux-loss-coeff 0.01") == 1
    assert argv[argv.index("--expert-model-parallel-size") + 1] == "8"
    assert "--expert-tensor-parallel-size" not in argv  # Megatron-LM's default: etp = tp


def test_dense_and_moe_layers_uniform_in_megatrons_sense() -> None:
    """DeepSeek-style: first layer dense, then MoE; the MoE layers carry ep/etp, the dense one
    not: still exactly one Megatron-LM command line."""
    argv = [*BASE, *MOE, "--moe-layer-freq", "([0]*1+[1]*3)", "--tensor-model-parallel-size",
            "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
            "--expert-tensor-parallel-size", "1", "--moe-shared-expert-intermediate-size", "64",
            "--moe-ffn-hidden-size", "32", "--moe-router-pre-softmax",
            "--moe-router-topk-scaling-factor", "2.5", "--moe-z-loss-coeff", "0.001",
            "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy", "position",
            "--use-distributed-optimizer"]
    plan = _plan(argv, 8)
    assert [(s.ep, s.etp) for s in plan.layers] == [(1, None), (2, 1), (2, 1), (2, 1)]
    assert not plan.is_uniform()  # different LayerStrategy objects, one Megatron layout
    moe = plan.model.moe
    assert moe is not None
    assert (moe.layer_freq, moe.ffn_hidden_size, moe.shared_expert_intermediate_size) == (
        (0, 1, 1, 1), 32, 64)
    assert (moe.router_pre_softmax, moe.router_topk_scaling_factor, moe.z_loss_coeff,
            moe.capacity_factor, moe.token_drop_policy) == (True, 2.5, 0.001, 1.5, "position")
    out = _round_trip(plan)
    text = " ".join(out)
    assert "--moe-layer-freq ([0]+[1]*3)" in text
    assert "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1" in text


def test_sigmoid_group_limited_routing_round_trips() -> None:
    argv = [*BASE, "--num-experts", "8", "--moe-router-topk", "4", "--moe-router-score-function",
            "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
            "0.002", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
            "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate"]
    plan = _plan(argv, 2)
    moe = plan.model.moe
    assert moe is not None
    assert (moe.router_score_function, moe.router_enable_expert_bias,
            moe.router_bias_update_rate, moe.router_num_groups, moe.router_group_topk,
            moe.router_load_balancing_type, moe.shared_expert_gate) == (
        "sigmoid", True, 0.002, 4, 2, "seq_aux_loss", True)
    _round_trip(plan)


def test_per_layer_expert_degrees_need_the_plan_file(tmp_path: Path) -> None:
    model = ModelSpec(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_query_groups=4, vocab_size=512,
                      moe=MoESpec(num_experts=4, aux_loss_coeff=0.01))
    layers = (LayerStrategy(dp=4, ep=2),) * 2 + (LayerStrategy(dp=4, ep=4),) * 2
    plan = ParallelPlan(world_size=4, pp=1, stages=((0, 4),), layers=layers, model=model,
                        micro_batch_size=4, global_batch_size=8, seq_length=32)
    path = tmp_path / "plan.json"
    plan.save(path)
    out = plan_to_megatron_args(plan, plan_path=str(path))
    assert out.uses_strategy_config
    assert any("per-layer expert degrees (ep 2, 4" in r for r in out.needs_megatron_ext)
    assert "--expert-model-parallel-size" not in out.argv
    again = _plan(list(out.argv), 4)
    assert again == plan
    with pytest.raises(PlanError, match=re.escape(
            "--expert-model-parallel-size=2 conflicts with --strategy-config")):
        parse_megatron_args([*out.argv, "--expert-model-parallel-size", "2"], world_size=4)
    with pytest.raises(PlanError, match=re.escape(
            "--moe-router-topk conflicts with --strategy-config")):
        parse_megatron_args([*out.argv, "--moe-router-topk", "3"], world_size=4)
    dense = dataclasses.replace(plan, model=dataclasses.replace(model, moe=None),
                                layers=(LayerStrategy(dp=4),) * 4)
    dense.save(path)
    with pytest.raises(PlanError, match="--num-experts conflicts with --strategy-config"):
        parse_megatron_args(["--strategy-config", str(path), "--num-experts", "4",
                             "--disable-bias-linear"], world_size=4)


@pytest.mark.parametrize(("extra", "world", "message"), [
    (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size=2 needs "
     "--num-experts"),
    (["--moe-ffn-hidden-size", "32"], None, "--moe-ffn-hidden-size needs --num-experts"),
    ([*MOE, "--expert-model-parallel-size", "3"], None, "--num-experts=4 is not a multiple of "
     "--expert-model-parallel-size=3"),
    ([*MOE, "--tensor-model-parallel-size", "2"], None, "--num-experts with "
     "--tensor-model-parallel-size=2 needs --sequence-parallel"),
    ([*MOE, "--moe-token-dispatcher-type", "flex"], None, "--moe-token-dispatcher-type flex: "),
    ([*MOE, "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"], None,
     "--moe-aux-loss-coeff has 1 values for 2"),
    ([*MOE[:-2], "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
      "--moe-aux-loss-coeff", "0.1", "0.2"], None, "--moe-router-load-balancing-type aux_loss "
     "seq_aux_loss: several load-balancing losses"),
    ([*MOE, "--moe-shared-expert-overlap", "--moe-shared-expert-intermediate-size", "64"], None,
     "--moe-shared-expert-overlap needs --moe-token-dispatcher-type alltoall"),
    ([*MOE, "--moe-pad-expert-input-to-capacity"], None,
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    ([*MOE, "--moe-layer-freq", "([0]+[1]*2)"], None, "--moe-layer-freq ([0]+[1]*2) gives 3 "
     "layers but --num-layers=4"),
    ([*MOE, "--moe-router-enable-expert-bias"], None, "router_enable_expert_bias=true needs "
     "router_score_function='sigmoid'"),
    (["--num-experts", "4", "--moe-router-topk", "1"], None, "router_topk=1 with softmax "
     "routing needs router_pre_softmax=true"),
    ([*MOE, "--moe-router-group-topk", "2"], None, "group-limited routing needs both"),
    ([*MOE, "--moe-router-num-groups", "3", "--moe-router-group-topk", "2"], None,
     "router_num_groups=3 must divide num_experts=4"),
    ([*MOE, "--moe-layer-freq", "([0]*4)"], None, "makes no layer MoE"),
    ([*MOE, "--moe-router-load-balancing-type", "sinkhorn"], None,
     "aux_loss_coeff=0.01 with router_load_balancing_type='sinkhorn'"),
    ([*MOE, "--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0",
      "--moe-expert-capacity-factor", "1"], None, "capacity_factor with "
     "router_load_balancing_type='sinkhorn'"),
    ([*MOE, "--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"], 4,
     "world size 4 is not divisible by --expert-tensor-parallel-size x "
     "--expert-model-parallel-size x --pipeline-model-parallel-size = 8"),
    ([*MOE, "--use-torch-fsdp2", "--expert-model-parallel-size", "2",
      "--no-gradient-accumulation-fusion"], None, "--use-torch-fsdp2 is not supported with "
     "expert parallelism"),
    ([*MOE, "--moe-layer-recompute"], None, "--moe-layer-recompute: recomputing the MoE layer "
     "alone"),
])
def test_megatron_moe_rules(extra: list[str], world: int | None, message: str) -> None:
    with pytest.raises(PlanError) as err:
        parse_megatron_args([*BASE, *extra], world_size=world)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bias_is_refused_for_moe() -> None:
    argv = [a for a in BASE if a != "--disable-bias-linear"]
    with pytest.raises(PlanError, match="^--num-experts needs --disable-bias-linear"):
        parse_megatron_args([*argv, *MOE])


def test_megatron_defaults_and_dense_flags() -> None:
    """--num-experts 0 is a dense model (Megatron-LM); MoE flags without experts change nothing,
    as in Megatron-LM; --moe-ffn-hidden-size defaults to --ffn-hidden-size."""
    dense = _plan([*BASE, "--num-experts", "0", "--moe-router-topk", "4"], 2)
    assert dense.model.moe is None and "ep" not in json.dumps(dense.to_dict()["layers"])
    moe = _plan([*BASE, *MOE, "--expert-tensor-parallel-size", "1"], 2).model.moe
    assert moe is not None and moe.ffn_hidden_size == 0  # = ffn_hidden_size, Megatron's default
    ns = parse_megatron_args([*BASE, *MOE, "--moe-router-dtype", "fp32", "--moe-input-jitter-eps",
                              "0.01", "--moe-expert-capacity-factor", "1.0",
                              "--moe-pad-expert-input-to-capacity"])
    assert (ns.moe_router_dtype, ns.moe_input_jitter_eps, ns.moe_pad_expert_input_to_capacity,
            ns.moe_token_dispatcher_type, ns.moe_grouped_gemm) == (
        "fp32", 0.01, True, "allgather", False)
    assert ns.moe_ffn_hidden_size == 128 and "moe_ffn_hidden_size" in ns.derived_args


def test_cli_plan_from_args_validate_and_args_on_an_moe_plan(tmp_path: Path, capsys) -> None:
    """The commands on an MoE plan: plan-from-args writes it, validate and args read it, and the
    printed flags are the ones given (a dense first layer, then MoE layers with ep 2, etp 1)."""
    from megatron_ext.cli import main

    flags = [*BASE, *MOE, "--moe-layer-freq", "([0]+[1]*3)", "--tensor-model-parallel-size", "2",
             "--sequence-parallel", "--expert-model-parallel-size", "2",
             "--expert-tensor-parallel-size", "1", "--moe-router-pre-softmax"]
    path = tmp_path / "moe.json"
    assert main(["plan-from-args", "--world-size", "4", "--out", str(path), "--", *flags]) == 0
    err = capsys.readouterr().err
    assert "  moe: 4 experts, top-2 (pre-softmax), expert FFN 128, 3 of 4 layers MoE, aux_loss " \
           "0.01\n" in err
    assert "  [  1,   4)  stage 0  tp2+sp dp2 ep2 etp1\n" in err
    assert main(["validate", str(path)]) == 0
    assert "moe: 4 experts" in capsys.readouterr().err
    assert main(["args", str(path)]) == 0
    argv = capsys.readouterr().out.splitlines()
    again = plan_from_megatron_args(parse_megatron_args(argv, world_size=4), 4)
    assert again == ParallelPlan.load(path)
    assert argv[argv.index("--moe-layer-freq") + 1] == "([0]+[1]*3)"
