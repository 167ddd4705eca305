"""A small on-disk training corpus for end-to-end tests (no downloads): JSONL documents, a
byte-level BPE tokenizer trained on them (gpt2-vocab.json / gpt2-merges.txt), and the Megatron
indexed dataset `corpus_text_document` written by tools/preprocess_data.py (--append-eod unless
asked not to)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def write_corpus(root: Path, docs: list[str], *, append_eod: bool = True) -> list[str]:
    """Write `docs` under `root`, tokenise and index them; returns pretrain_gpt data flags
    (--data-path, --tokenizer-type, --vocab-file, --merge-file). Without `append_eod` the
    documents run into each other with no end-of-document token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.model.save(str(root), "gpt2")  # gpt2-vocab.json, gpt2-merges.txt
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                 str(root / "gpt2-vocab.json"), "--merge-file", str(root / "gpt2-merges.txt")]
    subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input",
         str(root / "corpus.jsonl"), "--output-prefix", str(root / "corpus"), *tokenizer,
         *(["--append-eod"] if append_eod else [])],
        check=True, capture_output=True, text=True, timeout=300)
    return ["--data-path", str(root / "corpus_text_document"), *tokenizer]
