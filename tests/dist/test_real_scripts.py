"""Four real Megatron-LM core_v0.16.1 command lines (tests/data/megatron_lm), scaled down, train
on CPU under examples/pretrain_gpt.py (4 gloo ranks, torchrun).

Scaling down replaces only sizes: the model's widths and depth, sequence and batch lengths, the
run length, and parallel degrees above what 4 ranks hold; the data, tokenizer, checkpoint and
log-directory flags point at a test corpus and a temporary directory. Every other flag, including
the ones logged as having no effect here, is passed as the source has it. Each run must finish,
log a finite loss every iteration, and print the no-effect notes for the flags that have them.

- examples/train_gpt3_175b_distributed: GPT-3 (learned positions, LayerNorm, gelu), tp 8 -> 2,
  pp 16 -> 2, --fp16 kept. It combines --rampup-batch-size with iteration-based --train-iters,
  which Megatron-LM's own validate_args refuses ("expected no batch-size rampup for
  iteration-based training"), so that one flag is dropped and a separate test checks the refusal.
- modelopt_conf/meta-llama__Llama-3.1-8B-Instruct plus the training flags a launcher adds:
  RoPE base 500000 with Llama 3 scaling, GQA, SwiGLU, RMSNorm, untied embeddings.
- functional_tests/gpt3_mcore_tp1_pp2: a GPT functional-test config with its logging, rerun and
  determinism switches.
- modelopt_conf/Qwen__Qwen3-30B-A3B plus the launcher's training flags and expert degrees (ep 2,
  etp 1 beside tp 2 + SP): mixture of experts (128 -> 4 experts, top-8 -> top-2, expert width
  scaled), alltoall dispatcher and fp32 router as the file has them, q/k norms, GQA.
"""

from __future__ import annotations

import json
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
PRETRAIN = REPO / "examples" / "pretrain_gpt.py"
DATA = REPO / "tests" / "data" / "megatron_lm"
LOSS_LINE = re.compile(r" iteration +(\d+)/ *\d+ \|.* lm loss: ([0-9.E+-]+|nan|inf) \|")
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "one", "small",
         "cat", "sat", "on", "red", "mat", "and", "ran", "to", "big", "house")
ITERS = 4

# flag -> scaled value (sizes only); flags absent from the source stay absent
SIZES = {
    "--num-layers": "4", "--hidden-size": "64", "--ffn-hidden-size": "176",
    "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "16",
    "--seq-length": "32", "--max-position-embeddings": "64", "--micro-batch-size": "1",
    "--global-batch-size": "4", "--train-iters": str(ITERS), "--eval-iters": "1",
    "--eval-interval": str(ITERS), "--log-interval": "1", "--save-interval": str(ITERS),
    "--lr-decay-iters": str(ITERS), "--lr-warmup-iters": "1",
    "--num-workers": "0",
    "--num-experts": "4", "--moe-router-topk": "2", "--moe-ffn-hidden-size": "32",
}
DEGREES = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size"}  # at most 2 each
# data, tokenizer and output locations: replaced by the test's (value-taking flags)
PLUMBING = {"--data-path", "--vocab-file", "--merge-file", "--tokenizer-type", "--tokenizer-model",
            "--save", "--load", "--tensorboard-dir", "--data-cache-path", "--split",
            "--vocab-size", "--make-vocab-size-divisible-by"}
DROPPED = {"--rampup-batch-size": 3}  # flag -> values it takes


def _source(name: str) -> list[str]:
    return list(json.loads((DATA / f"{name}.json").read_text())["argv"])


def scale_down(argv: list[str], corpus: list[str], out: Path) -> list[str]:
    scaled: list[str] = []
    i = 0
    while i < len(argv):
        flag = argv[i]
        takes = 1 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 0
        if flag in DROPPED:
            i += 1 + DROPPED[flag]
            continue
        if flag in PLUMBING:
            i += 1 + takes
            continue
        if flag in SIZES:
            scaled += [flag, SIZES[flag]]
        elif flag in DEGREES:
            scaled += [flag, str(min(int(argv[i + 1]), 2))]
        else:
            scaled += argv[i:i + 1 + takes]
        i += 1 + takes
    return [*scaled, *corpus, "--split", "90,10,0", "--save", str(out / "ckpt"), "--cpu"]


# a model-flag file: the launcher adds the run's flags (their sizes are scaled like the rest)
LLAMA_TRAINING = ["--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
                  "--train-iters", "1", "--global-batch-size", "1", "--save-interval", "1",
                  "--log-interval", "1",
                  "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
CASES = {
    "gpt3_175b": ("examples/train_gpt3_175b_distributed", []),
    "llama31_8b": ("modelopt_conf/meta-llama__Llama-3.1-8B-Instruct", LLAMA_TRAINING),
    "functional_gpt3_tp1_pp2": ("functional_tests/gpt3_mcore_tp1_pp2", []),
    "qwen3_30b_a3b_moe": ("modelopt_conf/Qwen__Qwen3-30B-A3B",
                          [*LLAMA_TRAINING, "--expert-model-parallel-size", "2",
                           "--expert-tensor-parallel-size", "1"]),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("real_scripts_data")
    rng = random.Random(0)
    return write_corpus(root, [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
                               for _ in range(200)])


def _torchrun(argv: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(PRETRAIN), *argv]
    return subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900, env=dict(os.environ), cwd=REPO)


def test_rampup_is_refused_before_training(corpus: list[str], tmp_path: Path) -> None:
    """As in Megatron-LM: batch-size ramp-up needs sample-based training, one line, no launch."""
    from megatron_ext.errors import PlanError
    from megatron_ext.flags.parser import parse_megatron_args
    from megatron_ext.flags.schedule import check_schedule_flags

    argv = scale_down(_source("examples/train_gpt3_175b_distributed"), corpus, tmp_path)
    ns = parse_megatron_args([*argv, "--rampup-batch-size", "16", "16", "5859375"])
    with pytest.raises(PlanError, match=r"^--rampup-batch-size needs sample-based training"):
        check_schedule_flags(ns)


@pytest.mark.parametrize("case", sorted(CASES))
def test_scaled_down_script_trains(case: str, corpus: list[str], tmp_path: Path) -> None:
    name, extra = CASES[case]
    argv = scale_down(_source(name) + extra, corpus, tmp_path)
    result = _torchrun(argv)
    log = result.stdout
    assert result.returncode == 0, log[-4000:]
    losses = {int(it): float(loss) for it, loss in LOSS_LINE.findall(log)}
    assert sorted(losses) == list(range(1, ITERS + 1)), log[-3000:]
    assert all(math.isfinite(v) for v in losses.values()), losses
    if "--log-num-zeros-in-grad" in argv:
        assert "--log-num-zeros-in-grad has no effect here" in log
    if "--num-experts" in argv:  # the experts ran: Megatron-LM's balancing loss is logged
        assert len(re.findall(r"\| load_balancing_loss: [0-9.E+-]+ \|", log)) == ITERS, log[-3000:]
