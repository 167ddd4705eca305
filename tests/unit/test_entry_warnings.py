"""Every entry point filters the third-party warnings README promises to filter.

Each entry runs as a user runs it, in a fresh interpreter with Python's default warning filters
(no PYTHONWARNINGS, no pytest.ini): `megatron-ext` and each subcommand's --help,
examples/pretrain_gpt.py --help, every tools/*.py --help, and short real runs that import
megatron-core: `megatron-ext profile model`, tools/preprocess_data.py, and pretrain_gpt.py
training, saving and then loading a checkpoint (megatron-core's loader warned on every load).
Their stderr must hold no warning of the filtered kinds (megatron_ext/warning_filters.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WARNING = re.compile(r"\b(UserWarning|FutureWarning|DeprecationWarning)\b|warnings\.warn\(")
SUBCOMMANDS = ("search", "evaluate", "args", "plan-from-args", "flags", "validate",
               "profile hardware", "profile model", "flexsp plan", "launch")
NOT_SCRIPTS = {  # tools/*.py that are modules other tools import, not scripts with --help
    "tools/bench_costmodel_runs.py": "tools/bench_costmodel.py's plans and per-rank measurement",
}
TOOLS = sorted(p.name for p in (REPO / "tools").glob("*.py")
               if f"tools/{p.name}" not in NOT_SCRIPTS)


def _run(argv: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600,
                          check=False, cwd=cwd, env=env)


def _quiet(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    noisy = [x for x in result.stderr.splitlines() if WARNING.search(x)]
    assert not noisy, "\n".join(noisy)


def test_not_scripts_are_real_modules_without_main() -> None:
    """Each excluded path exists and is no script (no `__main__` block): a moved, renamed or
    deleted module, or one that became a script, fails here instead of silently narrowing the
    check."""
    for path, why in NOT_SCRIPTS.items():
        assert (REPO / path).is_file(), f"{path} ({why}) does not exist; update NOT_SCRIPTS"
        assert "__main__" not in (REPO / path).read_text(), (
            f"{path} is a script now; drop it from NOT_SCRIPTS")


@pytest.mark.parametrize("command", ["", *SUBCOMMANDS])
def test_cli_help_is_quiet(command: str) -> None:
    _quiet(_run(["-m", "megatron_ext.cli", *command.split(), "--help"]))


@pytest.mark.parametrize("script", ["examples/pretrain_gpt.py", *(f"tools/{t}" for t in TOOLS)])
def test_script_help_is_quiet(script: str) -> None:
    _quiet(_run([script, "--help"]))


def test_profile_model_run_is_quiet(tmp_path: Path) -> None:
    result = _run(["-m", "megatron_ext.cli", "profile", "model", "--model", "tiny-gpt", "--out",
                   str(tmp_path / "model.json"), "--tp", "1", "--micro-batch-sizes", "1",
                   "--seq-lengths", "32"])
    _quiet(result)
    assert (tmp_path / "model.json").is_file()


def test_preprocess_and_training_with_checkpoint_load_are_quiet(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = "the quick brown fox jumps over a lazy dog".split()
    docs = [" ".join(words[(i * 7 + j) % 9] for j in range(30 + i % 11)) for i in range(60)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.model.save(str(tmp_path), "gpt2")
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "gpt2-vocab.json",
                 "--merge-file", "gpt2-merges.txt"]
    _quiet(_run([str(REPO / "tools" / "preprocess_data.py"), "--input", "corpus.jsonl",
                 "--output-prefix", "corpus", *tokenizer, "--append-eod", "--workers", "1"],
                cwd=tmp_path))
    train = [str(REPO / "examples" / "pretrain_gpt.py"), "--cpu", "--transformer-impl", "local",
             "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "64", "--micro-batch-size", "2",
             "--lr", "1e-3", "--data-path", "corpus_text_document", "--split", "100,0,0",
             *tokenizer, "--num-workers", "0", "--save", "ckpt", "--load", "ckpt",
             "--save-interval", "2", "--train-iters", "3"]
    _quiet(_run([*train, "--exit-interval", "2"], cwd=tmp_path))
    resumed = _run(train, cwd=tmp_path)
    _quiet(resumed)
    assert "loaded ckpt/iter_0000002" in resumed.stdout, resumed.stdout[-2000:]
