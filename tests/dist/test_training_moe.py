"""A Mixture-of-Experts model through examples/pretrain_gpt.py on 4 gloo ranks, and its
checkpoint resumed under other expert-parallel sizes (experts resharded by global index).

  A   --num-experts 4 --moe-router-topk 2, EP2 (dp4), alltoall dispatcher, aux loss 0.01,
      4 iterations, checkpoints at 2 and 4: the layerwise backend trains it and logs Megatron-LM's
      `load_balancing_loss` on every iteration line.
  E4  EP4 loading A's iteration 2 (weights and Adam moments): iterations 3-4 continue A.
  E1  EP1 under TP2 + SP (experts sharded over expert-tp 2), allgather dispatcher, loading A's
      iteration 2: iterations 3-4 continue A.
Mock data and the NullTokenizer: nothing to write or download.
Tolerance: rel 1e-5 on the logged global mean loss, as test_checkpoint_formats.py: the plans only
sum in other orders (all-to-all regrouping, TP partial sums), a few fp32 ulps; a misplaced expert
or lost moments move iteration 4 by > 1e-3.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "examples" / "pretrain_gpt.py"
LINE = re.compile(r" iteration +(\d+)/ *\d+ \|.* lm loss: ([0-9.E+-]+) \|"
                  r" load_balancing_loss: ([0-9.E+-]+) \|")
FLAGS = [
    "--cpu", "--transformer-impl", "local", "--num-layers", "4", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "64",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
    "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96",
    "--moe-aux-loss-coeff", "0.01", "--train-iters", "4",
]
REL = 1e-5  # see the module docstring


def _run(argv: list[str]) -> tuple[str, dict[int, tuple[float, float]]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", str(PRETRAIN), *FLAGS, *argv]
    # generous: four ranks share two cores with whatever else runs on the machine
    result = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout, {int(i): (float(lm), float(lb))
                           for i, lm, lb in LINE.findall(result.stdout)}


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, Path]:
    save = tmp_path_factory.mktemp("moe_ep2")
    log, losses = _run(["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                        "alltoall", "--save", str(save), "--save-interval", "2"])
    return log, losses, save


def _from_iteration_2(source: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "iter_0000002").symlink_to(source / "iter_0000002")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    return ckpt


def test_moe_model_trains_and_logs_the_load_balancing_loss(run_a) -> None:
    log, losses, _ = run_a
    assert "backend: layerwise" in log and "ep2" in log
    assert sorted(losses) == [1, 2, 3, 4]
    assert losses[4][0] < losses[1][0]
    # E * sum_i f_i P_i: 1 for perfectly balanced routing, at most E / k = 2
    assert all(1.0 <= lb < 2.0 for _, lb in losses.values()), losses


@pytest.mark.parametrize("argv", [
    ["--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall"],
    ["--expert-model-parallel-size", "1", "--tensor-model-parallel-size", "2",
     "--sequence-parallel", "--moe-token-dispatcher-type", "allgather"],
], ids=["ep4", "ep1-tp2-sp"])
def test_moe_checkpoint_resumes_under_another_expert_parallel_size(
        run_a, argv: list[str], tmp_path: Path) -> None:
    _, expected, source = run_a
    _, got = _run([*argv, "--load", str(_from_iteration_2(source, tmp_path))])
    assert sorted(got) == [3, 4], got
    for i in (3, 4):
        assert got[i][0] == pytest.approx(expected[i][0], rel=REL), (i, got, expected)
        assert got[i][1] == pytest.approx(expected[i][1], rel=REL), (i, got, expected)
