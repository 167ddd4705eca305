"""bf16 training resumed under another plan, end to end (examples/pretrain_gpt.py, 4 gloo ranks).

  R  plan A (tp=2 x dp=2, distributed optimizer), --bf16, 8 iterations, a checkpoint every 4:
     the uninterrupted reference.
  A  R's iteration 4 resumed under plan A: iterations 5-8 equal R's bit for bit (bf16 weights,
     their fp32 main copies, Adam's moments, the scheduler and the data position restored).
  B  R's iteration 4 resumed under plan B (pp=2 x dp=2, DDP without the distributed optimizer):
     iterations 5-8 continue R's losses within REL.
  C  the control: plan B from the same checkpoint with --no-load-optim (fresh Adam moments,
     the fp32 main copies rebuilt from the bf16 weights): differs from R by more than REL, so
     B's comparison can fail.

Tolerance REL = 2e-3 relative per loss. Under another plan the same bf16 numbers are summed in
another order (TP partial sums of the attention and MLP matmuls are gone, the pipeline sends
bf16 activations between stages, the loss and gradients are reduced over other groups): each
bf16 rounding is 2^-8 = 3.9e-3 relative at worst, but the logged loss is an fp32 mean over
16 x 32 tokens whose rounding errors mostly cancel, so 2e-3 leaves room for the four steps'
drift while the control (fresh moments, learning-rate schedule restarted) falls outside it.
Dropout is off: RNG states are per rank and restart under another plan.
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
LOSS_LINE = re.compile(r" iteration +(\d+)/ *\d+ \|.* lm loss: ([0-9.E+-]+) \|")
FLAGS = [
    "--cpu", "--transformer-impl", "local", "--num-layers", "4", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "64",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", "16",
    "--train-iters", "8", "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1",
    "--eval-iters", "0", "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0",
]
PLAN_A = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
PLAN_B = ["--pipeline-model-parallel-size", "2"]
REL = 2e-3  # see the module docstring
TIMEOUT_S = 900  # four ranks share two cores with whatever else runs on the machine


def _torchrun(argv: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", str(PRETRAIN), *FLAGS, *argv]
    result = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=TIMEOUT_S, cwd=REPO)
    assert result.returncode == 0, result.stdout[-4000:]
    return result


def _losses(result: subprocess.CompletedProcess[str]) -> dict[int, float]:
    return {int(it): float(loss) for it, loss in LOSS_LINE.findall(result.stdout)}


def _close(got: dict[int, float], expected: dict[int, float]) -> bool:
    return got.keys() == expected.keys() and all(
        abs(got[i] - expected[i]) <= REL * abs(expected[i]) for i in expected)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], Path]:
    save = tmp_path_factory.mktemp("bf16_reference")
    result = _torchrun([*PLAN_A, "--save", str(save), "--save-interval", "4"])
    losses = _losses(result)
    assert sorted(losses) == list(range(1, 9)), result.stdout[-3000:]
    return losses, save


def _resume(save: Path, plan: list[str], *extra: str) -> subprocess.CompletedProcess[str]:
    return _torchrun([*plan, "--load", str(save), "--ckpt-step", "4", *extra])


def test_bf16_resume_under_the_same_plan_is_bit_exact(
        reference: tuple[dict[int, float], Path]) -> None:
    expected, save = reference
    result = _resume(save, PLAN_A)
    assert _losses(result) == {i: expected[i] for i in range(5, 9)}


def test_bf16_resume_under_another_plan_continues_the_losses(
        reference: tuple[dict[int, float], Path]) -> None:
    expected, save = reference
    later = {i: expected[i] for i in range(5, 9)}
    resumed = _resume(save, PLAN_B)
    assert "weights restored (resharded from another plan); optimizer state restored " \
        "(resharded)" in resumed.stdout, resumed.stdout[-3000:]
    got = _losses(resumed)
    assert _close(got, later), (got, later)

    control = _losses(_resume(save, PLAN_B, "--no-load-optim"))
    assert not _close(control, later), (control, later)  # the comparison can fail
