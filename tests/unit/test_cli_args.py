"""`megatron-ext args` and `megatron-ext plan-from-args`, run in-process through cli.main."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.cli import main
from megatron_ext.flags.emit import plan_to_megatron_args
from megatron_ext.plan import ParallelPlan
from megatron_ext.specs import ModelSpec

PLANS_DIR = Path(__file__).resolve().parents[2] / "examples" / "plans"
UNIFORM = PLANS_DIR / "llama2-7b_uniform_tp2_pp2.json"
HETERO = PLANS_DIR / "llama2-7b_hetero_pp2.json"
LAYOUT = PLANS_DIR / "gpt3-1.3b_tp2_pp4_layout.json"


def run(capsys: Any, *argv: str) -> tuple[int, str, list[str]]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def test_args_prints_one_token_per_line(capsys: Any) -> None:
    code, out, err = run(capsys, "args", str(UNIFORM))
    assert code == 0 and err == []
    tokens = out.splitlines()
    assert tokens[:2] == ["--num-layers", "32"]
    for flag, value in [("--tensor-model-parallel-size", "2"), ("--micro-batch-size", "1"),
                        ("--recompute-granularity", "selective")]:
        assert tokens[tokens.index(flag) + 1] == value
    assert {"--sequence-parallel", "--use-distributed-optimizer", "--bf16"} <= set(tokens)
    assert out.endswith("\n") and "" not in tokens


def test_args_for_heterogeneous_plan_adds_strategy_config_and_a_note(capsys: Any) -> None:
    code, out, err = run(capsys, "emit-args", str(HETERO))
    assert code == 0
    assert out.splitlines()[-2:] == ["--strategy-config", str(HETERO)]
    assert "--tensor-model-parallel-size" not in out and "--micro-batch-size" not in out
    assert len(err) == 1 and err[0].startswith(
        "megatron-ext: note: this plan needs megatron_ext's pretrain_gpt.py"
    )
    assert "per-layer tp (1, 2, 4)" in err[0]
    code, out, _ = run(capsys, "args", str(HETERO), "--plan-path", "/workspace/plan.json")
    assert code == 0 and out.splitlines()[-2:] == ["--strategy-config", "/workspace/plan.json"]


def test_mapfile_keeps_layout_strings_intact(tmp_path: Path) -> None:
    """What sbatch scripts do; `*` and `|` must survive (unquoted $(...) would glob/split)."""
    (tmp_path / "Et1").write_text("")  # something `Et*...` could glob onto
    script = 'mapfile -t A < <("$0" -m megatron_ext.cli args "$1"); printf "%s\\n" "${A[@]}"'
    result = subprocess.run(
        ["bash", "-c", script, sys.executable, str(LAYOUT)], cwd=tmp_path,
        capture_output=True, text=True, timeout=120, check=True,
    )
    expected = plan_to_megatron_args(ParallelPlan.load(LAYOUT)).argv
    assert tuple(result.stdout.splitlines()) == expected
    assert "Et*5|t*6|t*7|t*6L" in expected


def test_plan_from_args_round_trip_through_files(tmp_path: Path, capsys: Any) -> None:
    code, out, _ = run(capsys, "args", str(UNIFORM))
    out_path = tmp_path / "plan.json"
    code, stdout, err = run(capsys, "plan-from-args", "--world-size", "8", "--out",
                            str(out_path), "--", *out.splitlines())
    assert code == 0 and stdout == ""
    assert err[0].startswith("plan for custom on 8 ranks, pp=2")
    assert err[1].split() == ["[", "0,", "16)", "stage", "0", "tp2+sp", "dp2/z1", "rc:selective"]
    back = json.loads(out_path.read_text())
    original = json.loads(UNIFORM.read_text())
    assert {k: v for k, v in back.items() if k not in ("model", "cluster")} == {
        k: v for k, v in original.items() if k not in ("model", "cluster")
    }
    # fields the example plan omits take their defaults; the round trip writes them all
    assert ModelSpec.from_dict(back["model"]) == ModelSpec.from_dict(
        {**original["model"], "name": "custom"})


def test_plan_from_args_to_stdout_with_world_size_from_env(
    capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    flags = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--max-position-embeddings", "64", "--seq-length", "64", "--micro-batch-size", "2",
             "--vocab-size", "512", "--tensor-model-parallel-size", "2"]
    code, out, _ = run(capsys, "plan-from-args", "--", *flags)
    assert code == 0
    plan = ParallelPlan.from_dict(json.loads(out))
    assert (plan.world_size, plan.layers[0].tp, plan.layers[0].dp) == (4, 2, 2)
    assert (plan.micro_batch_size, plan.global_batch_size) == (4, 4)
    monkeypatch.delenv("WORLD_SIZE")
    code, out, err = run(capsys, "plan-from-args", "--", *flags)
    assert code == 0 and "assuming world size 2 (data-parallel size 1)" in err[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan-from-args", "--world-size", "8", "--", "--foo"],
         "megatron-ext: error: --foo is not a Megatron flag megatron_ext accepts"),
        (["plan-from-args", "--world-size", "8", "--", "--moe-latent-size", "8"],
         "megatron-ext: error: --moe-latent-size 8: latent MoE projections (Nemotron-H style) is "
         "not supported"),
        (["plan-from-args", "--world-size", "8"], "megatron-ext: error: no Megatron flags given"),
        (["plan-from-args", "--world-size", "0", "--", "--num-layers", "2"],
         "megatron-ext: error: --world-size=0 must be >= 1"),
        (["args", "/nonexistent/plan.json"], "megatron-ext: error: cannot read plan file"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys: Any, argv: list[str], message: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err) == 1 and err[0].startswith(message), err


def test_a_closed_pipe_ends_quietly():
    """`megatron-ext flags --class no_effect | head -1` (~77 KB, more than a pipe buffer holds,
    so the write really meets the closed pipe) prints one line and no BrokenPipeError."""
    cmd = f"{sys.executable} -m megatron_ext.cli flags --class no_effect | head -1"
    out = subprocess.run(cmd, shell=True, capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.count("\n") == 1 and "no effect here" in out.stdout
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr
