"""End to end: examples/pretrain_gpt.py --flexsp under torchrun on 4 gloo ranks.

A tiny corpus of documents of random lengths (a repeated sentence: one pattern to learn, so a
few steps suffice) is tokenised with tools/preprocess_data.py (--append-eod). Samples of 96
tokens are cut at EOD into variable-length documents; the FlexSP planner groups them per step
(--flexsp-min-group-size 2, so every group runs Ulysses all-to-alls); ZeRO-1 with overlapped
gradient reduction. The loss must be finite and fall over 6 steps, and every step logs its plan.
"""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.corpus import write_corpus

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
LOSS_LINE = re.compile(r" iteration +(\d+)/ *\d+ \|.* lm loss: ([0-9.E+-]+) \|")
PLAN_LINE = re.compile(r"flexsp: (\d+) sequences, (\d+) tokens, longest (\d+); (\d+) micro-batches "
                       r"((?:<[0-9x,]+> ?)+)")
SENTENCE = ("the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "and", "runs",
            "to", "the", "river")


def _write_data(root: Path) -> list[str]:
    rng = random.Random(0)
    docs = [" ".join(SENTENCE[i % len(SENTENCE)] for i in range(rng.randint(3, 60)))
            for _ in range(300)]
    return [*write_corpus(root, docs), "--split", "100,0,0"]


def test_pretrain_gpt_flexsp_trains(tmp_path: Path) -> None:
    data = _write_data(tmp_path)
    argv = [
        "--cpu", "--transformer-impl", "local", "--flexsp", "--flexsp-min-group-size", "2",
        "--flexsp-max-group-size", "4", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--seq-length", "96", "--max-position-embeddings", "96",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "6",
        "--lr", "1e-2", "--lr-warmup-iters", "0", "--log-interval", "1", *data,
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", str(REPO / "examples" / "pretrain_gpt.py"), *argv]
    # generous: four ranks share two cores with whatever else runs on the machine
    result = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=600, env=dict(os.environ), cwd=REPO)
    result.stderr = result.stdout  # one stream in order: the log (stdout) and errors (stderr)
    assert result.returncode == 0, result.stderr[-4000:]
    losses = [float(x) for _, x in sorted((int(i), x) for i, x in
                                          LOSS_LINE.findall(result.stderr))]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses), result.stderr[-3000:]
    # random init: ~ln(300) = 5.7; one repeated sentence is learnt within a few steps
    assert losses[-1] < losses[0] - 1.0, losses
    plans = PLAN_LINE.findall(result.stderr)
    assert len(plans) == 6, result.stderr[-3000:]
    degrees = {int(d) for *_, shapes in plans for d in re.findall(r"(\d+)x", shapes)}
    assert degrees and min(degrees) >= 2, plans  # --flexsp-min-group-size 2: Ulysses everywhere
    assert all(int(longest) <= 96 for _, _, longest, _, _ in plans), plans


def test_flexsp_rejects_attention_dropout_before_launch() -> None:
    from megatron_ext.errors import PlanError
    from megatron_ext.flags.parser import parse_megatron_args

    argv = ["--flexsp", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "96", "--max-position-embeddings", "96", "--micro-batch-size", "1"]
    with pytest.raises(PlanError, match=r"--attention-dropout=0.1 with --flexsp.*0$"):
        parse_megatron_args(argv, world_size=4)
    parse_megatron_args([*argv, "--attention-dropout", "0"], world_size=4)
