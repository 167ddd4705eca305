"""End to end, 4 gloo ranks: one checkpoint format for the three backends (stock GPTModel, the
layerwise runtime, FlexSP), resumed across them with weights and optimizer state.

One corpus without end-of-document tokens, so a FlexSP sample is a single document and every
backend computes the same causal loss on the same samples; dropout off; fp32.
  S   stock (tp=2, dp=2, distributed optimizer, --overlap-grad-reduce --overlap-param-gather),
      6 iterations, a checkpoint every 2: each save comes right after an optimizer step whose
      weight all-gather the flag defers to the next forward, so it must gather first, as
      Megatron-LM's force_param_sync does (else H and T resume from one-step-old shards).
  H   a heterogeneous plan (layers 0-1 tp=2 + SP, dp=2, ZeRO-1; layers 2-3 tp=2, Ulysses 2),
      loading S's iteration 2 (weights and Adam moments; one optimizer per rank saved them, two
      of different kinds load them): iterations 3-4 continue S's losses.
  T   stock (tp=1, dp=4) loading H's iteration 4: iterations 5-6 continue S's losses.
  F   FlexSP (4 ranks, one data-parallel group), 4 iterations, a checkpoint at 2.
  FH  a heterogeneous plan (layers 0-1 dp=4 ZeRO-3, layers 2-3 Ulysses 2 x dp=2) loading F's
      iteration 2: iterations 3-4 continue F's losses.
Tolerance: rel 1e-5 on the logged global mean loss. Only reduction orders differ between the
plans (TP partial sums, Ulysses all-to-alls, DDP bucket sums over different groups), which moves
the loss by a few float32 ulps (~1e-7 relative); a misplaced shard or lost Adam moments change
it by >1e-3 (iteration 4 is computed after one update from the loaded moments).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.corpus import write_corpus

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "examples" / "pretrain_gpt.py"
LOSS_PATTERN = r" iteration +(\d+)/ *\d+ \|.* lm loss: ([0-9.E+-]+) \|"
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "one",
         "small", "cat", "sat", "on", "red", "mat", "and", "ran", "to", "big", "house")
MODEL = [
    "--cpu", "--transformer-impl", "local", "--num-layers", "4", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "64",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
    "--lr", "3e-3",
    "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0",
]
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "8"]  # plan files carry their own
REL = 1e-5  # see the module docstring
STRATEGY = {"cp": 1, "ulysses": 1, "zero": 0, "recompute": "none", "sp": False}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("format_data")
    rng = random.Random(1)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) for _ in range(300)]
    return [*write_corpus(root, docs, append_eod=False), "--split", "100,0,0"]


def _run(argv: list[str]) -> dict[int, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", str(PRETRAIN), *MODEL, *argv]
    # generous: four ranks share two cores with whatever else runs on the machine
    result = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stdout[-4000:]
    return {int(i): float(x) for i, x in re.findall(LOSS_PATTERN, result.stdout)}


def _plan_file(ckpt: Path, layers: list[dict], path: Path) -> Path:
    """The plan recorded in `ckpt` with other per-layer strategies."""
    from megatron_ext.megatron_adapter.training.checkpoint import checkpoint_info

    plan = json.loads(checkpoint_info(ckpt)["plan"])
    plan["layers"] = [{**STRATEGY, **layer} for layer in layers]
    plan["flexsp"] = None
    plan["prediction"] = None
    path.write_text(json.dumps(plan))
    return path


def _continues(got: dict[int, float], expected: dict[int, float], iterations: range) -> None:
    assert sorted(got) == list(iterations), got
    for i in iterations:
        assert got[i] == pytest.approx(expected[i], rel=REL), (i, got, expected)


@pytest.fixture(scope="module")
def stock(data: list[str], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    save = tmp_path_factory.mktemp("format_stock")
    losses = _run([*data, *BATCH, "--tensor-model-parallel-size", "2", "--train-iters", "6",
                   "--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--overlap-param-gather", "--save", str(save), "--save-interval", "2"])
    assert sorted(losses) == list(range(1, 7))
    return losses, save


@pytest.fixture(scope="module")
def hetero_from_stock(data: list[str], stock: tuple[dict, Path],
                      tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    expected, source = stock
    ckpt = tmp_path_factory.mktemp("format_s2") / "ckpt"
    ckpt.mkdir()
    (ckpt / "iter_0000002").symlink_to(source / "iter_0000002")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    plan = _plan_file(ckpt, [{"start": 0, "end": 2, "tp": 2, "sp": True, "dp": 2, "zero": 1},
                             {"start": 2, "end": 4, "tp": 2, "ulysses": 2, "dp": 1}],
                      ckpt.parent / "hetero.json")
    save = tmp_path_factory.mktemp("format_hetero")
    losses = _run([*data, "--strategy-config", str(plan), "--load", str(ckpt), "--train-iters",
                   "6", "--exit-interval", "4", "--save", str(save), "--save-interval", "2"])
    return losses, save


def test_stock_checkpoint_resumes_under_a_heterogeneous_plan(
        stock: tuple[dict, Path], hetero_from_stock: tuple[dict, Path]) -> None:
    _continues(hetero_from_stock[0], stock[0], range(3, 5))


def test_heterogeneous_checkpoint_resumes_under_a_stock_plan(
        data: list[str], stock: tuple[dict, Path], hetero_from_stock: tuple[dict, Path]) -> None:
    losses = _run([*data, *BATCH, "--load", str(hetero_from_stock[1]), "--train-iters", "6"])
    _continues(losses, stock[0], range(5, 7))


def test_flexsp_checkpoint_resumes_under_a_heterogeneous_plan(
        data: list[str], tmp_path: Path) -> None:
    save = tmp_path / "flexsp"
    flexsp = _run([*data, *BATCH, "--flexsp", "--flexsp-max-group-size", "4", "--train-iters", "4",
                   "--save", str(save), "--save-interval", "2"])
    assert sorted(flexsp) == [1, 2, 3, 4]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "iter_0000002").symlink_to(save / "iter_0000002")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    plan = _plan_file(ckpt, [{"start": 0, "end": 2, "tp": 1, "dp": 4, "zero": 3},
                             {"start": 2, "end": 4, "tp": 1, "ulysses": 2, "dp": 2}],
                      tmp_path / "hetero.json")
    losses = _run([*data, "--strategy-config", str(plan), "--load", str(ckpt),
                   "--train-iters", "4"])
    _continues(losses, flexsp, range(3, 5))
