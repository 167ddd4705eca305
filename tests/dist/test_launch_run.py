"""`megatron-ext launch` for real: torchrun starts 2 gloo ranks that train and save; a run with a
bad layout is refused by the launcher in one line, before torchrun; a resume under another layout
and ZeRO level runs and keeps the optimizer state.

Run 1 trains ZeRO-1 (--use-distributed-optimizer, dp=2) for 2 of 4 iterations and saves. Run 2 asks
for tp=3 on 2 ranks: refused by the launcher (one line, exit 2, nothing from torchrun). Run 3
asks for tp=2 without the distributed optimizer: the launcher checks the checkpoint's record
(parameter-keyed optimizer state reshards to any plan) and torchrun resumes it at iteration 3
with the weights and the Adam state resharded from dp=2 ZeRO-1 to tp=2.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = str(REPO / "examples" / "pretrain_gpt.py")
FLAGS = ["--cpu", "--transformer-impl", "local", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "64",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--log-interval", "1",
         "--num-workers", "0", "--save-interval", "2"]
ITERATION = re.compile(r"\]  iteration +(\d+)/ +(\d+) \|")


def _launch(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "megatron_ext.cli", "launch", "--standalone",
           "--nproc_per_node", "2", PRETRAIN, *FLAGS, "--save", str(tmp_path / "ckpt"),
           "--load", str(tmp_path / "ckpt"), *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False,
                          cwd=tmp_path, env=env)


def test_launch_trains_refuses_a_bad_layout_and_resumes_under_another(
        tmp_path: Path) -> None:
    # the same --train-iters in every run: the resumed learning-rate schedule must match it
    first = _launch(tmp_path, "--train-iters", "4", "--exit-interval", "2",
                    "--use-distributed-optimizer")
    assert first.returncode == 0, first.stderr[-4000:]
    assert first.stderr.startswith("megatron-ext launch: checked custom on 2 ranks, pp=1, stock "
                                   "backend, no checkpoint; starting torchrun\n"), first.stderr
    assert [m.group(1) for m in map(ITERATION.search, first.stdout.splitlines()) if m] == [
        "1", "2"], first.stdout  # rank 0's log: torchrun ran the workers
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"

    refused = _launch(tmp_path, "--train-iters", "4", "--tensor-model-parallel-size", "3")
    assert refused.returncode == 2, refused.stderr[-4000:]
    assert refused.stdout == ""
    assert refused.stderr.startswith(
        "megatron-ext launch: error: --tensor-model-parallel-size=3 "), refused.stderr
    assert refused.stderr.count("\n") == 1, refused.stderr

    resumed = _launch(tmp_path, "--train-iters", "4", "--tensor-model-parallel-size", "2")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "iter_0000002" in resumed.stderr.splitlines()[0], resumed.stderr
    assert "optimizer state restored (resharded)" in resumed.stdout + resumed.stderr
    assert [m.group(1) for m in map(ITERATION.search, resumed.stdout.splitlines()) if m] == [
        "3", "4"], resumed.stdout
