"""`megatron-ext launch`: bad flags, plans and --load end in one line and exit 2 before torchrun.

Each case runs the real console script in a subprocess. The launcher prints
"megatron-ext launch: error: ..." and nothing else: had torchrun started, its workers would print
"pretrain_gpt.py: error: ..." and torchrun its failure summary. A good command line that really
starts torchrun is tests/dist/test_launch.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.commands import launch

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = str(REPO / "examples" / "pretrain_gpt.py")
FLAGS = ["--cpu", "--transformer-impl", "local", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
         "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]


def _launch(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "megatron_ext.cli", "launch", *argv],
                          capture_output=True, text=True, timeout=300, check=False, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("megatron-ext launch: error: "), lines[0]
    return lines[0].removeprefix("megatron-ext launch: error: ")


def test_flag_typo_is_one_line_with_the_closest_flag() -> None:
    error = _one_error_line(_launch("--nproc_per_node", "4", PRETRAIN, *FLAGS, "--hiden-size",
                                    "64"))
    assert error.startswith("--hiden-size is not a Megatron flag"), error
    assert "did you mean --hidden-size?" in error


def test_layout_that_does_not_fit_the_world_size_names_the_flag() -> None:
    error = _one_error_line(_launch("--nproc_per_node", "4", PRETRAIN, *FLAGS,
                                    "--tensor-model-parallel-size", "3"))
    assert error.startswith("--tensor-model-parallel-size=3 does not divide world size 4; "
                            "use one of 1, 2, 4"), error


def test_tp3_plan_file_names_tp(tmp_path: Path) -> None:
    plan = json.loads((REPO / "examples/plans/llama2-7b_hetero_pp2.json").read_text())
    plan["layers"][0]["tp"] = 3
    (tmp_path / "tp3.json").write_text(json.dumps(plan))
    error = _one_error_line(_launch("--nproc_per_node", "8", PRETRAIN, "--cpu",
                                    "--strategy-config", str(tmp_path / "tp3.json"),
                                    "--train-iters", "2", "--lr", "1e-3", "--mock-data",
                                    "--tokenizer-type", "NullTokenizer"))
    assert "layers[0:10].tp=3 does not divide 4" in error and ".dp" not in error.split(";")[1]


def test_world_size_comes_from_nnodes_times_nproc_per_node(tmp_path: Path) -> None:
    """A plan for 8 ranks launched on 2 x 2: the plan's world size is compared to 4."""
    error = _one_error_line(_launch("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend",
                                    "c10d", "--rdzv-endpoint", "localhost:0", PRETRAIN, "--cpu",
                                    "--strategy-config",
                                    "examples/plans/llama2-7b_hetero_pp2.json",
                                    "--train-iters", "2", "--lr", "1e-3", "--mock-data",
                                    "--tokenizer-type", "NullTokenizer"))
    assert "8" in error and "4" in error, error


def test_damaged_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("garbage")
    error = _one_error_line(_launch("--nproc_per_node", "2", PRETRAIN, *FLAGS, "--load",
                                    str(tmp_path / "ckpt")))
    assert error.startswith(f"--load={tmp_path / 'ckpt'}: latest_checkpointed_iteration.txt "
                            "is damaged"), error


def test_bad_torchrun_option_is_one_line() -> None:
    error = _one_error_line(_launch("--nproc_per_node", "lots", PRETRAIN, *FLAGS))
    assert error.startswith("torchrun: --nnodes=1:1 --nproc-per-node=lots:"), error
    error = _one_error_line(_launch("--nproc_per_node", "2"))
    assert error.startswith("torchrun: the following arguments are required: training_script")


def test_torchrun_command_line_is_read_by_torchs_parser() -> None:
    script, args, world = launch._parse_torchrun(["--nproc_per_node", "4", "--", "x.py", "--a"])
    assert (script, args, world) == ("x.py", ["--a"], 4)
    assert launch._parse_torchrun(["--nnodes", "1:4", "--nproc-per-node", "8", "x.py"])[2] is None
    assert launch._parse_torchrun(["--standalone", "--nproc-per-node", "3", "x.py"])[2] == 3
    assert launch._parse_torchrun(["--nnodes", "2", "--nproc-per-node", "8", "-m", "pkg.mod",
                                   "--flag"]) == ("-m pkg.mod", ["--flag"], 16)
    assert launch._is_pretrain_gpt(PRETRAIN)
    assert not launch._is_pretrain_gpt(str(REPO / "tools" / "preprocess_data.py"))


def test_help_is_the_launchers_and_names_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "megatron-ext launch [torchrun options] examples/pretrain_gpt.py" in out
    assert "torchrun --help" in out
