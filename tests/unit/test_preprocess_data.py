"""tools/preprocess_data.py and the offline tokenizers: JSONL -> .bin/.idx that megatron-core reads.

Tokenizer files are made here with the `tokenizers` trainer (nothing is downloaded). Each check
reads the written dataset back through megatron-core's IndexedDataset and compares it with the
tokenizer applied directly, and decodes it back to the source text.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.training.preprocess import main
from megatron_ext.megatron_adapter.training.tokenizer import build_tokenizer

TEXTS = ["hello world, the quick brown fox.", "a lazy dog sleeps", "fox and dog: friends?",
         "über naïve café ☕"]  # non-ASCII: byte-level BPE must round-trip it


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.model.save(str(root), "gpt2")
    hf = root / "hf"
    hf.mkdir()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return root


def _gpt2_flags(files: Path) -> list[str]:
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(files / "gpt2-vocab.json"),
            "--merge-file", str(files / "gpt2-merges.txt")]


def _run(files: Path, prefix: Path, flags: list[str], *extra: str) -> IndexedDataset:
    argv = ["--input", str(files / "corpus.jsonl"), "--output-prefix", str(prefix), *flags, *extra]
    assert main(argv) == 0
    return IndexedDataset(f"{prefix}_text_document")


def test_gpt2_bpe_documents_match_the_tokenizer(files: Path, tmp_path: Path) -> None:
    tokenizer = build_tokenizer(tokenizer_type="GPT2BPETokenizer",
                                vocab_file=str(files / "gpt2-vocab.json"),
                                merge_file=str(files / "gpt2-merges.txt"))
    data = _run(files, tmp_path / "c", _gpt2_flags(files), "--append-eod")
    assert len(data) == len(TEXTS)
    assert data[0].dtype == np.uint16  # vocabulary < 65500: Megatron's optimal dtype
    for i, text in enumerate(TEXTS):
        ids = data[i].tolist()
        assert ids == tokenizer.tokenize(text) + [tokenizer.eod]
        assert tokenizer.detokenize(ids[:-1]) == text
    # As in Megatron-LM's GPT2BPETokenizer, EOD is the vocabulary's <|endoftext|> id (text that
    # spells it is BPE-encoded like any other text).
    vocab = json.loads((files / "gpt2-vocab.json").read_text())
    assert tokenizer.eod == vocab["<|endoftext|>"]


def test_workers_write_identical_files(files: Path, tmp_path: Path) -> None:
    _run(files, tmp_path / "one", _gpt2_flags(files), "--append-eod")
    _run(files, tmp_path / "two", _gpt2_flags(files), "--append-eod", "--workers", "2")
    for ext in (".bin", ".idx"):
        one = (tmp_path / f"one_text_document{ext}").read_bytes()
        assert one == (tmp_path / f"two_text_document{ext}").read_bytes()


def test_huggingface_tokenizer_json_uses_its_eos(files: Path, tmp_path: Path) -> None:
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(files / "hf")]
    data = _run(files, tmp_path / "hf", flags, "--append-eod")
    tokenizer = build_tokenizer(tokenizer_type="HuggingFaceTokenizer",
                                tokenizer_model=str(files / "hf" / "tokenizer.json"))
    eos = tokenizer.tokenize("</s>")
    assert len(eos) == 1 and tokenizer.eod == eos[0]
    assert data[3].tolist() == tokenizer.tokenize(TEXTS[3]) + eos


def test_null_tokenizer_reads_integers(tmp_path: Path) -> None:
    (tmp_path / "corpus.jsonl").write_text('{"text": "5 6 7"}\n{"text": "1"}\n')
    data = _run(tmp_path, tmp_path / "n", ["--tokenizer-type", "NullTokenizer", "--vocab-size",
                                           "100"], "--append-eod")
    from megatron_ext.megatron_adapter.training.tokenizer import build_tokenizer

    null = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=100)
    # megatron-core 0.16 adds the end-of-document id after --vocab-size; 0.19 makes it the last
    assert (null.vocab_size, null.eod) in {(101, 100), (100, 99)}
    eod = null.eod
    assert [data[0].tolist(), data[1].tolist()] == [[5, 6, 7, eod], [1, eod]]


@pytest.mark.parametrize(("corpus", "flags", "expected"), [
    ('{"text": "x"}\n', ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nope.json",
                         "--merge-file", "/nope.txt"], "--vocab-file=/nope.json does not exist"),
    ('{"text": "x"}\nnot json\n', None, "line 2 is not valid JSON"),
    ('{"body": "x"}\n', None, "line 1 has no string field 'text'; fix --json-keys"),
    ('{"text": "x"}\n', ["--tokenizer-type", "HuggingFaceTokenizer"],
     "--tokenizer-model is required for HuggingFaceTokenizer"),
])
def test_bad_input_is_one_line(files: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                               corpus: str, flags: list[str] | None, expected: str) -> None:
    (tmp_path / "corpus.jsonl").write_text(corpus)
    argv = ["--input", str(tmp_path / "corpus.jsonl"), "--output-prefix", str(tmp_path / "o"),
            *(flags or _gpt2_flags(files))]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_unsupported_tokenizer_type_names_the_choices() -> None:
    with pytest.raises(PlanError, match="SentencePieceTokenizer is not supported; use one of"):
        build_tokenizer(tokenizer_type="SentencePieceTokenizer")
