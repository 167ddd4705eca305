"""examples/pretrain_gpt.py under `torchrun --nproc_per_node 4`, read as a user reads the console.

- A flag typo: the one-line error is printed once (local rank 0) and is also the last thing
  torchrun prints (its root-cause block shows the line from the error file instead of "To enable
  traceback"); the other ranks do not appear in torchrun's failure list.
  The wall time is reported in the assertion messages and by tools/bench_entry.py, not asserted:
  torchrun's own import of torch dominates it and swings with the machine's load.
- A 4-rank training run: at most 25 lines before the first iteration line, each under 200
  characters, the first ones saying what runs; the training log on stdout, Megatron-LM's
  iteration line format kept; no third-party warnings.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "examples" / "pretrain_gpt.py"
ITERATION = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]  iteration +1/ +2 \| "
                       r"consumed samples: +8 \| elapsed time per iteration \(ms\): [0-9.]+ \| "
                       r"learning rate: [0-9.E+-]+ \| global batch size: +8 \| "
                       r"lm loss: [0-9.E+-]+ \|")
FLAGS = ["--cpu", "--transformer-impl", "local", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
         "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
         "--log-interval", "1", "--num-workers", "0", "--tensor-model-parallel-size", "2"]


def _torchrun(argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(PRETRAIN), *argv]
    # OMP_NUM_THREADS=1 is what torchrun sets anyway; given, torchrun skips its 4-line banner
    # (a 230-character line), which is torchrun's and not the project's to shorten.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Generous: four ranks share two cores with whatever else runs on the machine.
    return subprocess.run(cmd, check=False, text=True, timeout=900, cwd=REPO, env=env, **kwargs)


def test_flag_typo_ends_torchrun_output_with_the_one_line_error() -> None:
    start = time.perf_counter()
    result = _torchrun([*FLAGS, "--num-layerz", "2"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    wall_s = time.perf_counter() - start
    load = os.getloadavg()[0]
    note = f"(took {wall_s:.1f} s at load average {load:.1f})\n"
    lines = result.stdout.splitlines()
    error = ("pretrain_gpt.py: error: --num-layerz is not a Megatron flag megatron_ext accepts; "
             "did you mean --num-layers? (pretrain_gpt.py --help lists them)")
    assert result.returncode != 0, note + result.stdout
    assert lines.count(error) == 1, note + result.stdout  # local rank 0 prints it
    # the other local ranks exit 0 once local rank 0 reported: the summary lists it alone
    assert sum(error in x for x in lines) == 2, note + result.stdout
    assert "<NO_OTHER_FAILURES>" in result.stdout and "SIGTERM" not in result.stdout, result.stdout
    last = [x for x in lines if x.strip() and set(x.strip()) != {"="}][-1]
    assert last.strip() == f"traceback : {error}", note + result.stdout
    # The children never got as far as importing megatron-core.
    assert "Transformer Engine" not in result.stdout and "UserWarning" not in result.stdout


def test_training_console_is_short_and_says_what_runs() -> None:
    result = _torchrun(FLAGS, capture_output=True)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout.splitlines()
    first = next((i for i, x in enumerate(out) if ITERATION.match(x)), None)
    assert first is not None, result.stdout[-3000:]  # the iteration line, on stdout
    # Every stderr line counts as if printed before the first iteration (the streams are piped
    # apart).
    before = out[:first] + result.stderr.splitlines()
    assert len(before) <= 25, "\n".join(before)
    assert all(len(x) < 200 for x in before), max(before, key=len)
    head = "\n".join(out[:first])
    assert re.search(r"plan: \S+ on 4 ranks \(cpu, gloo\), pp=1, .* fp32", head), head
    assert "  layers [  0,   2)  stage 0  tp2 dp2" in head
    assert "  data: mock data; tokenizer NullTokenizer" in head
    assert "  load: none (random initialisation)" in head
    for noise in ("Warning", "warnings.warn", "Params for bucket", "DistributedDataParallelConfig",
                  "Traceback"):
        assert noise not in result.stdout + result.stderr, noise
    assert sum(bool(ITERATION.match(x)) for x in out) == 1  # rank 0 only
