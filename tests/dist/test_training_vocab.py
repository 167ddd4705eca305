"""End to end: examples/pretrain_gpt.py with vocabulary parallelism under torchrun, 4 gloo ranks.

Mock data (Megatron's MockGPTDataset, NullTokenizer), no downloads, dropout off, Megatron's
default learned absolute position embeddings. Two launches:
  A  `--vocab-parallel` with plain Megatron flags (pp=2, uneven stages 3+1, dp=2): 4 iterations,
     a checkpoint every 2; the loss is finite and falls.
  B  `--strategy-config` with a heterogeneous vocab_parallel plan of the same model (stage 0:
     tp2+sp, 3 layers; stage 1: dp2, 1 layer; 2 barriers), loading A's iteration 2 (weights
     and Adam state, resharded between plans with different gradient classes): iterations 3
     (computed before B's first update) and 4 (after an update from the loaded moments) equal
     A's within a stated tolerance (vocabulary shards, layers and moments resharded, data
     position restored).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "examples" / "pretrain_gpt.py"
LOSS_LINE = re.compile(r" iteration +(\d+)/ *\d+ \|.* lm loss: ([0-9.E+-]+) \|")
FLAGS = [
    "--cpu", "--transformer-impl", "local", "--num-layers", "4", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "64",
    "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "1000", "--num-workers", "0", "--train-iters", "4", "--lr", "3e-3",
    "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
]
PLAN_A = ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3",
          "--vocab-parallel", "--micro-batch-size", "2", "--global-batch-size", "8",
          "--eval-interval", "2", "--eval-iters", "1"]  # evaluation: forward-only passes
VALID_LINE = re.compile(r"validation loss at iteration +(\d+) \| lm loss value: ([0-9.E+-]+)")


def _torchrun(argv: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(PRETRAIN), *argv]
    # Generous: four ranks share two cores with whatever else runs on the machine.
    result = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=900, env=dict(os.environ), cwd=REPO)
    result.stderr = result.stdout  # one stream in order: the log (stdout) and errors (stderr)
    return result


def _losses(result: subprocess.CompletedProcess[str]) -> dict[int, float]:
    assert result.returncode == 0, result.stderr[-4000:]
    return {int(it): float(loss) for it, loss in LOSS_LINE.findall(result.stderr)}


def _hetero_plan(ckpt: Path, path: Path) -> Path:
    """A's plan (from its checkpoint record) with per-layer strategies and algorithm 2."""
    from megatron_ext.megatron_adapter.training.checkpoint import checkpoint_info

    plan = json.loads(checkpoint_info(ckpt)["plan"])
    assert plan["vocab"]["mode"] == "vocab_parallel", plan["vocab"]
    strategy = {"cp": 1, "ulysses": 1, "zero": 0, "recompute": "none"}
    plan["layers"] = [{"start": 0, "end": 3, "tp": 2, "sp": True, "dp": 1, **strategy},
                      {"start": 3, "end": 4, "tp": 1, "sp": False, "dp": 2, **strategy}]
    plan["vocab"]["algorithm"] = 2
    plan["prediction"] = None
    plan["model"]["vocab_size"] = 1000  # --vocab-size (the record holds NullTokenizer's 1001)
    path.write_text(json.dumps(plan))
    return path


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], Path, str]:
    save = tmp_path_factory.mktemp("vocab_ckpt_a")
    result = _torchrun([*FLAGS, *PLAN_A, "--save", str(save), "--save-interval", "2"])
    return _losses(result), save, result.stderr


def test_vocab_parallel_trains(run_a: tuple[dict[int, float], Path, str]) -> None:
    losses, save, stderr = run_a
    valid = {int(it): float(v) for it, v in VALID_LINE.findall(stderr)}
    assert sorted(valid) == [2, 4] and all(math.isfinite(v) for v in valid.values()), stderr[-2000:]
    assert sorted(losses) == [1, 2, 3, 4]
    assert all(math.isfinite(v) for v in losses.values()), losses
    # Random init over 1001 ids gives ~ln(1001) = 6.9; mock data is learnable at lr 3e-3.
    assert losses[4] < losses[1], losses
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "4"


def test_plan_file_resumes_under_a_heterogeneous_plan(
        run_a: tuple[dict[int, float], Path, str], tmp_path: Path) -> None:
    losses_a, save, _ = run_a
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(save / "iter_0000002", ckpt / "iter_0000002")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    plan = _hetero_plan(ckpt, tmp_path / "plan.json")
    # optimizer state across different gradient-class chains: keyed by parameter, it reshards
    result = _torchrun([*FLAGS, "--strategy-config", str(plan), "--load", str(ckpt)])
    losses_b = _losses(result)
    assert sorted(losses_b) == [3, 4], result.stderr[-3000:]
    assert "optimizer state restored (resharded)" in result.stderr
    # fp32, dropout off, same weights, moments and samples: only reduction orders differ (TP=2
    # + SP partial sums on stage 0, 1 vs 2 barriers in the vocabulary passes), ~1e-7 relative;
    # 1e-5 is far below what a misplaced vocabulary shard, layer or moment causes (>1e-3).
    for i in (3, 4):
        assert losses_b[i] == pytest.approx(losses_a[i], rel=1e-5), (losses_a, losses_b)
