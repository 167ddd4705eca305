"""Uniform context parallelism through examples/pretrain_gpt.py on CPU (2 gloo ranks, no
transformer-engine): megatron-core's local attention has no context parallelism, so select.py runs
the plan on the layerwise runtime's ring (p2p) / Ulysses (a2a) attention.

  A  cp=2 (ring), fp32, 6 iterations, saves at 3 and 6.
  R  A resumed from its iteration-3 checkpoint: iterations 4-6 equal A's bit for bit (model,
     optimizer, scheduler, RNG and data position restored; dropout 0 so no RNG stream differs).
  U  cp=2 --cp-comm-type a2a (Ulysses) in bf16: trains (finite losses) and saves.
Mock data and the NullTokenizer: no files to write, nothing downloaded.
"""

from __future__ import annotations

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
    "--cpu", "--transformer-impl", "local", "--num-layers", "2", "--hidden-size", "32",
    "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "32",
    "--position-embedding-type", "rope", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "100", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
    "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--context-parallel-size", "2",
]


def _torchrun(argv: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(PRETRAIN), *FLAGS, *argv]
    # Generous: two ranks share the machine's cores with whatever else runs.
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ), cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _log(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr  # the console logs progress to stdout, problems to stderr


def _losses(result: subprocess.CompletedProcess[str]) -> dict[int, str]:
    return {int(it): loss for it, loss in LOSS_LINE.findall(_log(result))}


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    save = tmp_path_factory.mktemp("cp_ckpt")
    return _torchrun(["--train-iters", "6", "--save", str(save), "--save-interval", "3"]), save


def test_cp_plan_runs_on_the_layerwise_ring_attention(run_a) -> None:
    result, _ = run_a
    assert "backend: layerwise" in _log(result)
    losses = _losses(result)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]


def test_cp_resume_is_bit_exact(run_a, tmp_path: Path) -> None:
    result, save = run_a
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(save / "iter_0000003", ckpt / "iter_0000003")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = _losses(_torchrun(["--train-iters", "6", "--load", str(ckpt)]))
    first = _losses(result)
    assert sorted(resumed) == [4, 5, 6]
    assert {i: first[i] for i in resumed} == resumed  # logged to 10 digits: bit-exact fp32 sums


def test_ulysses_cp_in_bf16_trains_and_saves(tmp_path: Path) -> None:
    result = _torchrun(["--train-iters", "3", "--cp-comm-type", "a2a", "--bf16", "--save",
                        str(tmp_path), "--save-interval", "3"])
    losses = _losses(result)
    assert sorted(losses) == [1, 2, 3] and all(0 < float(v) < 10 for v in losses.values())
    assert (tmp_path / "iter_0000003").is_dir()
