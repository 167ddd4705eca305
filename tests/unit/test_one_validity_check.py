"""One validity check (plan_checks.py) behind every command: an input one of `search`,
`validate`, `args`, `plan-from-args`, `evaluate` and the runtime's plan loader refuses, all of
them refuse, each with a one-line error (exit 2) naming the same rule."""

from __future__ import annotations

import json

import pytest

from megatron_ext.cli import main
from megatron_ext.errors import PlanError
from megatron_ext.geometry.vocab import vocab_parallel_layout
from megatron_ext.plan import ParallelPlan

UNIFORM = "examples/plans/llama2-7b_uniform_tp2_pp2.json"  # rope, max_position_embeddings 4096
VOCAB_PARALLEL = "examples/plans/tiny-llama_tp2_pp2_vocab_parallel.json"


def _one_line_error(capsys, argv, *needles) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    for needle in needles:
        assert needle in err, err


def _broken_copy(tmp_path, source: str, **changes) -> str:
    data = json.loads(open(source, encoding="utf-8").read())
    data.update(changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_sequence_longer_than_rope_positions_is_refused_everywhere(tmp_path, capsys):
    """Megatron-LM asserts max_position_embeddings >= seq_length for rope models too; search
    and validate used to accept such a plan that args then refused."""
    plan = _broken_copy(tmp_path, UNIFORM, seq_length=8192)
    rule = "max_position_embeddings=4096"
    for argv in (["validate", plan], ["args", plan], ["evaluate", plan]):
        _one_line_error(capsys, argv, "seq_length=8192 exceeds model." + rule)
    with pytest.raises(PlanError, match="seq_length=8192 exceeds model.max_position"):
        ParallelPlan.load(plan)  # what the runtime and pretrain_gpt.py load plans with
    _one_line_error(
        capsys,
        ["search", "--model", "llama2-7b", "--seq-length", "8192", "--global-batch-size", "8"],
        "--seq-length=8192 exceeds model." + rule,
    )
    flags = ParallelPlan.load(UNIFORM)
    argv = ["plan-from-args", "--world-size", str(flags.world_size), "--"]
    from megatron_ext.flags.emit import plan_to_megatron_args

    tokens = list(plan_to_megatron_args(flags).argv)
    tokens[tokens.index("--seq-length") + 1] = "8192"
    _one_line_error(capsys, argv + tokens, "--seq-length=8192 exceeds --max-position-embeddings")


def test_vocab_parallel_sequence_split_is_a_plan_rule(tmp_path, capsys):
    """The vocabulary-parallel passes split the sequence over the replicas the micro-batch
    leaves; a plan whose sequence does not split is refused when it is loaded (it used to pass
    validate and fail in the runtime), and the runtime's layout comes from the same function."""
    data = json.loads(open(VOCAB_PARALLEL, encoding="utf-8").read())
    data.update(world_size=8, micro_batch_size=2, cluster=None)
    data["vocab"]["tp"] = 1
    for run in data["layers"]:
        run.update(sp=False, dp=2)
    good = ParallelPlan.from_dict(data)
    layout = vocab_parallel_layout(good)
    assert (layout.dp, layout.ulysses) == (2, 2)  # 4 replicas: 2 samples, then 2 sequence halves
    data["seq_length"] = 63
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    for argv in (["validate", str(plan)], ["args", str(plan)], ["evaluate", str(plan)]):
        _one_line_error(capsys, argv, "seq_length=63 cannot be split over the 2 vocabulary")
