"""The Megatron-LM argument parser: names, defaults, refusals, cross-flag rules, plan mapping."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.flags.emit import plan_to_megatron_args
from megatron_ext.flags.parser import (
    parse_megatron_args,
    plan_from_megatron_args,
)
from megatron_ext.flags.to_plan import parse_layout
from megatron_ext.plan import ParallelPlan

PLANS_DIR = Path(__file__).resolve().parents[2] / "examples" / "plans"
BASE = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--max-position-embeddings", "256", "--seq-length", "64", "--micro-batch-size", "1",
        "--vocab-size", "512"]


def plan_of(*extra: str, world_size: int = 8) -> ParallelPlan:
    ns = parse_megatron_args([*BASE, *extra], world_size=world_size)
    return plan_from_megatron_args(ns, world_size)


def error_of(*extra: str, world_size: int | None = None, base: list[str] = BASE) -> str:
    with pytest.raises(PlanError) as info:
        ns = parse_megatron_args([*base, *extra], world_size=world_size)
        plan_from_megatron_args(ns, world_size or 8)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_megatron_defaults() -> None:
    ns = parse_megatron_args(BASE, megatron_version="0.16.1")  # 0.19: optim_grads_params
    expected: dict[str, Any] = {
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "context_parallel_size": 1, "cp_comm_type": ["p2p"], "num_query_groups": 1,
        "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
        "make_vocab_size_divisible_by": 128, "add_bias_linear": True, "swiglu": False,
        "ffn_hidden_size": 256, "kv_channels": 16, "attention_dropout": 0.1,
        "hidden_dropout": 0.1, "init_method_std": 0.02, "weight_decay": 0.01, "clip_grad": 1.0,
        "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8, "lr": None, "min_lr": 0.0,
        "lr_decay_style": "linear", "lr_warmup_iters": 0, "seed": 1234, "log_interval": 100,
        "eval_iters": 100, "eval_interval": None, "ckpt_format": "torch_dist",
        "transformer_impl": "transformer_engine", "distributed_backend": "nccl",
        "num_workers": 2, "rotary_base": 10000, "layernorm_epsilon": 1e-5,
        "global_batch_size": None,
        "gradient_accumulation_fusion": True, "data_parallel_sharding_strategy": "no_shard",
        "strategy_config": None, "vocab_parallel": False, "flexsp": False, "cpu": False,
    }
    assert {k: getattr(ns, k) for k in expected} == expected
    assert ns.derived_args == {"ffn_hidden_size", "kv_channels"}
    assert "hidden_size" in ns.explicit_args and "swiglu" not in ns.explicit_args


def test_derived_defaults_follow_megatron() -> None:
    ns = parse_megatron_args([*BASE, "--swiglu", "--tensor-model-parallel-size", "2"],
                             world_size=8)
    assert ns.ffn_hidden_size == int((4 * 64 * 2 / 3) / 64) * 64  # Megatron's swiglu default
    assert ns.global_batch_size == 4  # micro-batch-size x data-parallel size (8 / 2)
    assert "global_batch_size" in ns.derived_args


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--foo", "3"], "--foo is not a Megatron flag megatron_ext accepts"),
        (["--foo=3"], "--foo is not a Megatron flag megatron_ext accepts"),
        (["--tensor-model", "2"], "--tensor-model is not a Megatron flag megatron_ext accepts"),
        (["--num-experts", "8"], "--num-experts needs --disable-bias-linear"),
        (["--moe-use-upcycling"], "--moe-use-upcycling: upcycling a dense checkpoint into MoE "
         "is not supported"),
        (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type flex: the flex "
         "dispatcher"),
        (["--num-layers-per-virtual-pipeline-stage", "2"],
         "interleaved (virtual) pipeline stages need --pipeline-model-parallel-size > 1"),
        (["--microbatch-group-size-per-virtual-pipeline-stage", "4"],
         "--microbatch-group-size-per-virtual-pipeline-stage 4: a micro-batch group per "
         "virtual stage other than pp"),
        (["--fp4-format", "e2m1"], "--fp4-format e2m1: FP4 training"),
        (["stray"], "unexpected argument 'stray'"),
        (["--tensor-model-parallel-size", "0"],
         "argument --tensor-model-parallel-size: must be a positive integer, got '0'"),
        (["--seq-length"], "argument --seq-length: expected one argument"),
        (["--normalization", "BatchNorm"], "argument --normalization: invalid choice"),
    ],
)
def test_unknown_and_unsupported_flags(flags: list[str], message: str) -> None:
    assert error_of(*flags).startswith(message)


@pytest.mark.parametrize(
    ("flags", "world_size", "message"),
    [
        (["--fp16", "--bf16"], None, "--fp16 and --bf16 exclude each other"),
        (["--num-query-groups", "2"], None, ("--num-query-groups has no effect without "
         "--group-query-attention")),
        (["--group-query-attention", "--num-query-groups", "3"], None,
         "--num-query-groups=3 does not divide --num-attention-heads=4"),
        (["--seq-length", "512"], None,
         "--seq-length=512 exceeds --max-position-embeddings=256"),
        (["--context-parallel-size", "2", "--seq-length", "66"], None,
         "--seq-length=66 must be a multiple of 2 x --context-parallel-size=4"),
        (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"], None,
         "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),
        (["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "3"],
         None, "--hierarchical-context-parallel-sizes 2 3 must multiply to"),
        (["--recompute-granularity", "full"], None, ("--recompute-granularity full needs "
         "--recompute-method")),
        (["--recompute-activations", "--recompute-method", "block"], None,
         "--recompute-granularity selective takes no --recompute-method"),
        (["--recompute-granularity", "selective", "--recompute-modules", "mlp"], None,
         "--recompute-modules mlp is not supported yet"),
        (["--pipeline-model-parallel-size", "3"], None,
         "--num-layers=8 is not divisible by --pipeline-model-parallel-size=3"),
        (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "3"],
         None, "--decoder-first/last-pipeline-num-layers (3, None) leave 5"),
        (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*4|t*4L",
          "--decoder-first-pipeline-num-layers", "4"], None,
         "--pipeline-model-parallel-layout cannot be combined"),
        (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "E|t*8L"],
         None, "--pipeline-model-parallel-layout 'E|t*8L' gives stage 0 no transformer layer"),
        (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
          "Et*2|t*2|t*4L"], None, ("--pipeline-model-parallel-layout 'Et*2|t*2|t*4L' "
         "describes 3 stages for --pipeline-model-parallel-size=2; give a multiple of pp")),
        (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
         None, "--num-layers-per-virtual-pipeline-stage=3 does not divide the 4 layers"),
        (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
          "--decoder-first-pipeline-num-layers", "2"], None,
         "--num-layers-per-virtual-pipeline-stage cannot be combined with --decoder-first"),
        (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
          "--num-virtual-stages-per-pipeline-rank", "2"], None,
         "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
         "cannot be set together"),
        (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
          "--no-overlap-p2p-communication"], None,
         "interleaved pipelines with --no-overlap-p2p-communication need "
         "--pipeline-model-parallel-size > 2"),
        (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3"],
         None, "a pipeline stage of 4 layers does not split into 3 virtual stages"),
        (["--use-torch-fsdp2"], None, "--use-torch-fsdp2 needs --untie-embeddings-and-output"),
        (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"], None,
         "--use-torch-fsdp2 needs --no-gradient-accumulation-fusion"),
        (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"], None,
         "--use-megatron-fsdp: Megatron FSDP is not supported by megatron_ext; use "
         "--use-torch-fsdp2"),
        (["--overlap-param-gather"], None, ("--overlap-param-gather needs "
         "--use-distributed-optimizer")),
        (["--position-embedding-type", "none"], None, ("--position-embedding-type none is a "
         "Megatron setting megatron_ext does not support yet")),
        (["--tokenizer-type", "SentencePieceTokenizer"], None, ("--tokenizer-type "
         "SentencePieceTokenizer is a Megatron setting megatron_ext does not support yet")),
        (["--tokenizer-type", "GPT2BPETokenizer"], None, ("--tokenizer-type GPT2BPETokenizer "
         "needs --vocab-file")),
        (["--save", "/tmp/x"], None, "--save needs a positive --save-interval"),
        (["--lr", "1e-4", "--min-lr", "1e-3"], None, "--min-lr=0.001 exceeds --lr=0.0001"),
        (["--mock-data", "--data-path", "x"], None, "give one data source"),
        (["--vocab-parallel-algorithm", "2"], None, "--vocab-parallel-algorithm has no effect"),
        (["--tensor-model-parallel-size", "3"], 8, ("--tensor-model-parallel-size=3 does not "
         "divide world size 8; use one of 1, 2, 4, 8, or change the ranks")),
        (["--tensor-model-parallel-size", "4", "--context-parallel-size", "3",
          "--seq-length", "66"], 8,
         ("--context-parallel-size=3 does not divide the 2 ranks that world size 8 "
          "leaves over the other parallel sizes (4); use one of 1, 2, or change the ranks")),
        (["--global-batch-size", "6"], 4, ("--global-batch-size=6 is not a multiple of "
         "--micro-batch-size x data-parallel size = 1 x 4")),
        (["--tensor-model-parallel-size", "8"], 8, ("these Megatron flags give an invalid layout: "
         "layers[0:8].tp=8 does not divide num_attention_heads=4")),
    ],
)
def test_cross_flag_rules(flags: list[str], world_size: int | None, message: str) -> None:
    assert error_of(*flags, world_size=world_size).startswith(message)


def test_missing_required_flags() -> None:
    assert error_of(base=BASE[2:]).startswith("--num-layers is missing; Megatron-LM requires it")
    no_vocab = BASE[:-2]
    assert "--vocab-size is missing" in error_of(base=no_vocab)
    model = BASE[:8] + BASE[-2:]  # without --seq-length and --micro-batch-size
    assert error_of(base=model).startswith("--seq-length is missing")
    ns = parse_megatron_args(model, model_only=True)  # a model-shape file, e.g. for search
    assert (ns.seq_length, ns.micro_batch_size, ns.kv_channels) == (None, None, 16)


def test_sequence_parallel_at_tp1_is_dropped_with_a_warning(caplog: Any) -> None:
    with caplog.at_level(logging.WARNING):
        plan = plan_of("--sequence-parallel")
    assert not plan.layers[0].sp
    assert "disabling --sequence-parallel" in caplog.text


def test_context_parallel_kinds_map_to_cp_and_ulysses() -> None:
    ring = plan_of("--context-parallel-size", "4").layers[0]
    ulysses = plan_of("--context-parallel-size", "4", "--cp-comm-type", "a2a").layers[0]
    both = plan_of("--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                   "--hierarchical-context-parallel-sizes", "2", "2").layers[0]
    assert (ring.cp, ring.ulysses, ring.dp) == (4, 1, 2)
    assert (ulysses.cp, ulysses.ulysses, ulysses.dp) == (1, 4, 2)
    assert (both.cp, both.ulysses, both.dp) == (2, 2, 2)


def test_zero_levels() -> None:
    fsdp2 = ("--use-torch-fsdp2", "--untie-embeddings-and-output-weights",
             "--no-gradient-accumulation-fusion")
    assert plan_of().layers[0].zero == 0
    assert plan_of("--use-distributed-optimizer").layers[0].zero == 1
    assert plan_of(*fsdp2).layers[0].zero == 3


def test_recompute_is_per_pipeline_stage() -> None:
    block = plan_of("--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers",
                    "5", "--recompute-granularity", "full", "--recompute-method", "block",
                    "--recompute-num-layers", "4")
    assert [s.recompute for s in block.layers] == ["full"] * 4 + ["none"] + ["full"] * 3
    uniform = plan_of("--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "3")
    assert {s.recompute for s in uniform.layers} == {"full"}
    assert {s.recompute for s in plan_of("--recompute-activations").layers} == {"selective"}


@pytest.mark.parametrize(
    ("flags", "stages"),
    [
        ([], ((0, 2), (2, 4), (4, 6), (6, 8))),
        (["--decoder-first-pipeline-num-layers", "5"], ((0, 5), (5, 6), (6, 7), (7, 8))),
        (["--decoder-last-pipeline-num-layers", "5"], ((0, 1), (1, 2), (2, 3), (3, 8))),
        (["--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "1"],
         ((0, 3), (3, 5), (5, 7), (7, 8))),
        (["--pipeline-model-parallel-layout", "Et|(tt|)*2,t*3L"], ((0, 1), (1, 3), (3, 5),
                                                                   (5, 8))),
        (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
          "--num-layers", "10"], ((0, 2), (2, 5), (5, 8), (8, 10))),
    ],
)
def test_pipeline_splits(flags: list[str], stages: tuple[tuple[int, int], ...]) -> None:
    assert plan_of("--pipeline-model-parallel-size", "4", *flags).stages == stages


@pytest.mark.parametrize(
    "flags",
    [
        ["--num-layers-per-virtual-pipeline-stage", "1"],
        ["--num-virtual-stages-per-pipeline-rank", "2"],
        ["--num-virtual-stages-per-pipeline-rank", "2", "--decoder-first-pipeline-num-layers",
         "4", "--num-layers", "10"],
        ["--num-virtual-stages-per-pipeline-rank", "2", "--account-for-embedding-in-pipeline-split",
         "--account-for-loss-in-pipeline-split", "--num-layers", "14"],
        ["--pipeline-model-parallel-layout", "Et|t*2|t|t|t|t|t|tL", "--num-layers", "9"],
    ],
)
def test_interleaved_splits_match_megatron_core(flags: list[str]) -> None:
    """Chunk c of rank r is stages[c*pp + r] with the layer count megatron-core builds there."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    ns = parse_megatron_args([*BASE, "--pipeline-model-parallel-size", "4",
                              "--global-batch-size", "8", *flags], world_size=8)
    plan = plan_from_megatron_args(ns, 8)
    layout = ns.pipeline_model_parallel_layout
    if layout is not None:
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,
        )
        layout = PipelineParallelLayerLayout(layout, 4)
    config = TransformerConfig(
        num_layers=ns.num_layers, hidden_size=64, num_attention_heads=4,
        pipeline_model_parallel_size=4, pipeline_dtype=torch.float32,
        virtual_pipeline_model_parallel_size=plan.virtual_stages,
        num_layers_in_first_pipeline_stage=ns.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=ns.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=ns.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=ns.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=layout,
    )
    assert plan.virtual_stages > 1
    for c in range(plan.virtual_stages):
        for r in range(4):
            start, end = plan.stages[c * 4 + r]
            if layout is None:
                built = get_num_layers_to_build(config, vp_stage=c, pp_rank=r)
            else:  # its get_num_layers_to_build reads the initialised parallel state
                built = [t.name for t in layout.layout[r][c]].count("decoder")
            assert end - start == built
    emitted = plan_to_megatron_args(plan).argv
    again = plan_from_megatron_args(parse_megatron_args(list(emitted), world_size=8), 8)
    assert (again.stages, again.virtual_stages) == (plan.stages, plan.virtual_stages)


def test_layout_parser_matches_megatron_core() -> None:
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    for text in ["Et*3|tL", "E|(t|)*3,m|m||L", "Ettt|(tt|)*29,m|L", "(|ab)*2,cd", "Et*12|t*13L"]:
        ours = parse_layout(text)
        try:
            theirs = [[t.name for t in stage]
                      for stage in PipelineParallelLayerLayout.parse_str_to_list(text)]
        except AssertionError:  # mcore rejects unknown characters; we do later, with a message
            assert not set("".join(map("".join, ours))) <= set("ELtm")
            continue
        names = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
        assert [[names[c] for c in stage] for stage in ours] == theirs, text


def test_strategy_config_is_read_once(tmp_path: Path, monkeypatch: Any) -> None:
    """Parsing and deriving the plan read the --strategy-config file once, not once each."""
    path = tmp_path / "plan.json"
    path.write_text((PLANS_DIR / "llama2-7b_hetero_pp2.json").read_text())
    reads: list[object] = []
    original = ParallelPlan.load.__func__

    def counting_load(cls: type, source: object) -> ParallelPlan:
        reads.append(source)
        return original(cls, source)

    monkeypatch.setattr(ParallelPlan, "load", classmethod(counting_load))
    ns = parse_megatron_args(["--strategy-config", str(path), "--lr", "3e-4"], world_size=8)
    plan = plan_from_megatron_args(ns, 8)
    assert len(reads) == 1 and plan is ns.strategy_plan


def test_strategy_config_fills_and_checks(tmp_path: Path) -> None:
    src = PLANS_DIR / "llama2-7b_hetero_pp2.json"
    path = tmp_path / "plan.json"
    path.write_text(src.read_text())
    plan = ParallelPlan.load(path)
    ns = parse_megatron_args(["--strategy-config", str(path), "--lr", "3e-4"], world_size=8)
    assert (ns.num_layers, ns.hidden_size, ns.seq_length, ns.pipeline_model_parallel_size) == (
        32, 4096, 4096, 2)
    assert ns.tensor_model_parallel_size is None and ns.micro_batch_size is None  # per layer
    assert plan_from_megatron_args(ns, 8) == plan
    conflicts = {
        ("--tensor-model-parallel-size", "2"): "--tensor-model-parallel-size conflicts with "
        "--strategy-config", ("--hidden-size", "1024"): "--hidden-size conflicts with "
        "--strategy-config", ("--seq-length", "2048"): "--seq-length=2048 conflicts with "
        "--strategy-config", ("--fp16",): "--fp16=True conflicts with --strategy-config",
    }
    for flags, message in conflicts.items():
        with pytest.raises(PlanError, match="^" + message):
            parse_megatron_args(["--strategy-config", str(path), *flags], world_size=8)
    with pytest.raises(PlanError, match="is a plan for world_size=8 but this job has 16 ranks"):
        parse_megatron_args(["--strategy-config", str(path)], world_size=16)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(src.read_text()), "pp": 4}))
    with pytest.raises(PlanError, match=r"^--strategy-config .*bad.json: stages has 2 ranges"):
        parse_megatron_args(["--strategy-config", str(bad)])


def test_plans_megatron_cannot_print() -> None:
    plan = ParallelPlan.load(PLANS_DIR / "llama2-7b_hetero_pp2.json")
    with pytest.raises(PlanError, match="needs --strategy-config PLAN.json"):
        plan_to_megatron_args(plan)
    data = json.loads((PLANS_DIR / "tiny-llama_tp2_pp2_uneven.json").read_text())
    data["model"]["max_position_embeddings"] = 32  # rope: valid plan, but not for Megatron-LM
    with pytest.raises(PlanError, match="Megatron-LM requires --max-position-embeddings >= "):
        plan_to_megatron_args(ParallelPlan.from_dict(data))


@pytest.mark.parametrize(
    ("given", "suggested"),
    [("--hiden-size", "--hidden-size"), ("--num-layerz", "--num-layers"),
     ("--tensor-parallel-size", "--tensor-model-parallel-size"),
     ("--lr-warmup-iter", "--lr-warmup-iters"), ("--seqlength", "--seq-length"),
     ("--micro_batch_size", "--micro-batch-size"), ("--moe-router-top-k", "--moe-router-topk"),
     ("--xyz", None)],
)
def test_misspelt_flag_names_the_closest_one(given: str, suggested: str | None) -> None:
    error = error_of(given, "3")
    assert error.startswith(f"{given} is not a Megatron flag megatron_ext accepts; "), error
    if suggested is None:
        assert "did you mean" not in error and "check the spelling" in error
    else:
        assert f"did you mean {suggested}? " in error


def test_plan_from_args_and_cli_options_suggest_the_closest_name(capsys: Any) -> None:
    from megatron_ext.cli import main

    assert main(["plan-from-args", "--world-size", "8", "--", *BASE, "--hiden-size", "64"]) == 2
    assert "did you mean --hidden-size?" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["search", "--globl-batch-size", "8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean --global-batch-size?" in err
    with pytest.raises(SystemExit):
        main(["serch"])
    assert "did you mean search?" in capsys.readouterr().err
