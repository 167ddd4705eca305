"""Rebuild tests/data/ckpt_mcore016/: a checkpoint written by examples/pretrain_gpt.py under
megatron-core 0.16.1, with the corpus it was trained on and the losses of the run that wrote it.

Run from the repository root, in the Python 3.11 environment with megatron-core 0.16.1 (README,
"Install and run the main job"):

    python tests/data/make_mcore016_checkpoint.py

It writes a deterministic corpus (tokenizer files and the indexed dataset), trains the tiny model
of `FLAGS` for `TRAIN_ITERS` iterations on 2 gloo ranks with a checkpoint every `SAVE_AT`
iterations, keeps only the checkpoint of iteration `SAVE_AT`, and records in `reference.json`
the flags, the versions and the losses the uninterrupted run logged after that iteration.
tests/dist/test_checkpoint_cross_version.py resumes that checkpoint under the installed
megatron-core and compares its losses with these.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "data" / "ckpt_mcore016"
NPROC = 2
TRAIN_ITERS = 6
SAVE_AT = 3
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "one",
         "small", "cat", "sat", "on", "red", "mat")
# Data flags are appended by the test (paths under this fixture's copy); everything else is here.
FLAGS = [
    "--cpu", "--transformer-impl", "local",
    "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
    "--split", "100,0,0", "--make-vocab-size-divisible-by", "8",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--use-distributed-optimizer",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--train-iters", str(TRAIN_ITERS), "--log-interval", "1", "--eval-iters", "0",
]
LOSS_LINE = re.compile(r" iteration +(\d+)/ *\d+ \|.* lm loss: ([0-9.E+-]+) \|")


def data_flags(root: Path) -> list[str]:
    return ["--data-path", str(root / "corpus_text_document"), "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", str(root / "gpt2-vocab.json"), "--merge-file",
            str(root / "gpt2-merges.txt")]


def main() -> None:
    sys.path.insert(0, str(REPO))
    from tests.dist.corpus import write_corpus

    version = metadata.version("megatron-core")
    if version != "0.16.1":
        sys.exit(f"megatron-core {version} is installed; this fixture is written under 0.16.1")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) for _ in range(60)]
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    write_corpus(OUT, docs, append_eod=False)
    (OUT / "corpus.jsonl").unlink()  # the indexed dataset is what training reads
    with tempfile.TemporaryDirectory() as tmp:
        save = Path(tmp) / "ckpt"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(NPROC), str(REPO / "examples" / "pretrain_gpt.py"), *FLAGS,
               *data_flags(OUT), "--save", str(save), "--save-interval", str(SAVE_AT)]
        run = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        if run.returncode != 0:
            sys.exit(run.stdout[-4000:])
        losses = {int(i): loss for i, loss in LOSS_LINE.findall(run.stdout)}
        assert sorted(losses) == list(range(1, TRAIN_ITERS + 1)), run.stdout[-4000:]
        name = f"iter_{SAVE_AT:07d}"
        shutil.copytree(save / name, OUT / "checkpoint" / name)
    (OUT / "checkpoint" / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    shutil.rmtree(OUT / "corpus_text_document", ignore_errors=True)  # the dataset's index cache
    reference = {
        "megatron_core": version, "torch": metadata.version("torch"),
        "python": sys.version.split()[0], "nproc": NPROC, "flags": FLAGS,
        "saved_at": SAVE_AT, "losses": {str(i): losses[i] for i in range(SAVE_AT + 1,
                                                                          TRAIN_ITERS + 1)},
    }
    (OUT / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {OUT} (losses after iteration {SAVE_AT}: {reference['losses']})")


if __name__ == "__main__":
    main()
