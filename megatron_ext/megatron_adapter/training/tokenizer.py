"""Tokenizers for `--tokenizer-type`, built on megatron-core's tokenizer classes, fully offline.

megatron-core 0.16.1 routes GPT2BPETokenizer and HuggingFaceTokenizer through `transformers`
`AutoTokenizer.from_pretrained("gpt2", ...)`, which fetches files from the model hub. Here both
read local files with the `tokenizers` package instead (vocab.json + merges.txt, or a
tokenizer.json), wrapped in megatron-core's `MegatronTokenizerText` so megatron-core datasets and
the rest of the loop see the same object megatron-core would build. NullTokenizer is
megatron-core's own (its library name and end-of-document id differ by version: compat.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron.core.tokenizers.text.libraries.abstract_tokenizer import (
    MegatronTokenizerTextAbstract,
)
from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.compat import null_tokenizer as null_tokenizer_of_this_version

SUPPORTED_TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
GPT2_EOD_TOKEN = "<|endoftext|>"
# End-of-document candidates for a tokenizer.json without a tokenizer_config.json beside it.
_EOD_CANDIDATES = (GPT2_EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "<|eot_id|>")


class JsonTokenizerLibrary(MegatronTokenizerTextAbstract):
    """megatron-core tokenizer-library interface over a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: Any, eod_token: str) -> None:
        self.tokenizer = tokenizer
        eod_id = tokenizer.token_to_id(eod_token)
        assert eod_id is not None, f"{eod_token!r} is not in the vocabulary"
        self._eod_id = int(eod_id)

    def text_to_tokens(self, text: str) -> list[str]:
        return self.tokenizer.encode(text, add_special_tokens=False).tokens

    def tokens_to_text(self, tokens: list[str]) -> str:
        return self.ids_to_text(self.tokens_to_ids(tokens))

    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        return [self.tokenizer.token_to_id(t) for t in tokens]

    def ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.id_to_token(i) for i in ids]

    def text_to_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def ids_to_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def add_special_tokens(self, special_tokens: Any) -> None:
        raise NotImplementedError("add special tokens to the tokenizer files instead")

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def eos_id(self) -> int:
        return self._eod_id

    @property
    def pad_id(self) -> int:
        return -1  # no pad token: megatron-core datasets then use their own sentinel

    bos_id = cls_id = sep_id = mask_id = unk_id = pad_id


class LocalTextTokenizer(MegatronTokenizerText):
    """`MegatronTokenizerText` whose library object is given, not looked up by library name."""

    def __init__(self, path: str, library: MegatronTokenizerTextAbstract, library_name: str):
        self._given_library = library
        super().__init__(path, {"library": library_name})

    def _restore_model(self, **kwargs: Any) -> MegatronTokenizerTextAbstract:
        return self._given_library


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ModuleNotFoundError:
        raise PlanError(
            "--tokenizer-type GPT2BPETokenizer/HuggingFaceTokenizer need the `tokenizers` "
            "package; pip install tokenizers"
        ) from None
    return tokenizers


def _existing_file(path: str | None, flag: str, what: str) -> Path:
    if not path:
        raise PlanError(f"{flag} is required for this --tokenizer-type; give the {what}")
    file = Path(path)
    if not file.is_file():
        raise PlanError(f"{flag}={path} does not exist; give the path of the {what}")
    return file


def gpt2_bpe_tokenizer(vocab_file: str | None, merge_file: str | None) -> LocalTextTokenizer:
    """GPT-2 byte-level BPE from a vocab.json and a merges.txt (Megatron's GPT2BPETokenizer)."""
    tk = _import_tokenizers()
    vocab = _existing_file(vocab_file, "--vocab-file", "GPT-2 vocab.json")
    merges = _existing_file(merge_file, "--merge-file", "GPT-2 merges.txt")
    try:
        model = tk.models.BPE.from_file(str(vocab), str(merges))
    except Exception as err:  # noqa: BLE001 - the Rust reader raises plain Exception
        raise PlanError(
            f"--vocab-file/--merge-file could not be read as GPT-2 BPE: {err}") from None
    tokenizer = tk.Tokenizer(model)
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    if tokenizer.token_to_id(GPT2_EOD_TOKEN) is None:
        raise PlanError(f"--vocab-file={vocab_file} has no {GPT2_EOD_TOKEN!r} token; GPT-2 BPE "
                        "uses it as end of document")
    return LocalTextTokenizer(str(vocab), JsonTokenizerLibrary(tokenizer, GPT2_EOD_TOKEN),
                              "gpt2-bpe")


def _eod_token_of(tokenizer: Any, directory: Path) -> str | None:
    config = directory / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            return eos
    return next((t for t in _EOD_CANDIDATES if tokenizer.token_to_id(t) is not None), None)


def huggingface_tokenizer(tokenizer_model: str | None) -> LocalTextTokenizer:
    """A HuggingFace fast tokenizer from a local tokenizer.json (or a directory holding one)."""
    tk = _import_tokenizers()
    if not tokenizer_model:
        raise PlanError("--tokenizer-model is required for HuggingFaceTokenizer; give a "
                        "tokenizer.json or a directory containing one")
    path = Path(tokenizer_model)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise PlanError(f"--tokenizer-model={tokenizer_model} is not a tokenizer.json or a "
                        "directory with one; nothing is downloaded, give a local path")
    try:
        tokenizer = tk.Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - the Rust reader raises plain Exception
        raise PlanError(f"--tokenizer-model={tokenizer_model} is not a valid tokenizer.json: "
                        f"{err}") from None
    eod = _eod_token_of(tokenizer, file.parent)
    if eod is None:
        raise PlanError(f"--tokenizer-model={tokenizer_model} has no end-of-document token; add "
                        f"eos_token to tokenizer_config.json or one of {list(_EOD_CANDIDATES)}")
    return LocalTextTokenizer(str(file), JsonTokenizerLibrary(tokenizer, eod), "huggingface-json")


def null_tokenizer(vocab_size: int | None) -> MegatronTokenizerText:
    """megatron-core's NullTokenizer: ids are whitespace-separated integers; the end-of-document
    id is the installed version's (compat.null_tokenizer: vocab_size on 0.16, vocab_size - 1 on
    0.19)."""
    if not vocab_size or vocab_size < 1:
        raise PlanError(f"--vocab-size={vocab_size} must be >= 1 for NullTokenizer")
    return null_tokenizer_of_this_version(vocab_size)


def build_tokenizer(
    *, tokenizer_type: str | None, vocab_file: str | None = None, merge_file: str | None = None,
    tokenizer_model: str | None = None, vocab_size: int | None = None,
) -> MegatronTokenizerText:
    """The tokenizer Megatron-LM's `--tokenizer-type` names, from local files only."""
    if tokenizer_type == "GPT2BPETokenizer":
        return gpt2_bpe_tokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return huggingface_tokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return null_tokenizer(vocab_size)
    raise PlanError(f"--tokenizer-type={tokenizer_type} is not supported; use one of "
                    f"{', '.join(SUPPORTED_TOKENIZER_TYPES)}")
