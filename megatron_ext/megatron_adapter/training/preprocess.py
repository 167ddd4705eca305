"""JSONL text -> megatron-core indexed dataset (`PREFIX_KEY_document.bin/.idx`), as Megatron-LM's
`tools/preprocess_data.py` writes it: one document per JSON line, `--append-eod` adds the
tokenizer's end-of-document id, token dtype uint16 when the vocabulary fits, int32 otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.training.tokenizer import (
    SUPPORTED_TOKENIZER_TYPES,
    build_tokenizer,
)

logger = logging.getLogger(__name__)
_WORKER_STATE: dict[str, Any] = {}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"preprocess_data: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="preprocess_data.py", description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.bin/.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract")
    p.add_argument("--tokenizer-type", required=True, choices=SUPPORTED_TOKENIZER_TYPES)
    p.add_argument("--vocab-file", help="GPT-2 vocab.json (GPT2BPETokenizer)")
    p.add_argument("--merge-file", help="GPT-2 merges.txt (GPT2BPETokenizer)")
    p.add_argument("--tokenizer-model",
                   help="tokenizer.json or its directory (HuggingFaceTokenizer)")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size")
    p.add_argument("--append-eod", action="store_true", help="end every document with EOD")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--log-interval", type=int, default=10000, help="documents between reports")
    return p


def _tokenizer_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"tokenizer_type": args.tokenizer_type, "vocab_file": args.vocab_file,
            "merge_file": args.merge_file, "tokenizer_model": args.tokenizer_model,
            "vocab_size": args.vocab_size}


def _init_worker(tokenizer_kwargs: dict[str, Any], json_keys: list[str], append_eod: bool) -> None:
    _WORKER_STATE.update(tokenizer=build_tokenizer(**tokenizer_kwargs), json_keys=json_keys,
                         append_eod=append_eod)


def _encode(line_and_number: tuple[int, str]) -> tuple[int, dict[str, list[int]] | str, int]:
    """(line number, {key: ids} or an error message, bytes read)."""
    number, line = line_and_number
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as err:
        return number, f"line {number} is not valid JSON ({err.msg})", len(line)
    tokenizer = _WORKER_STATE["tokenizer"]
    out: dict[str, list[int]] = {}
    for key in _WORKER_STATE["json_keys"]:
        text = doc.get(key) if isinstance(doc, dict) else None
        if not isinstance(text, str):
            return number, f"line {number} has no string field {key!r}; fix --json-keys", len(line)
        ids = list(tokenizer.tokenize(text))
        if _WORKER_STATE["append_eod"]:
            ids.append(tokenizer.eod)
        out[key] = ids
    return number, out, len(line)


def _lines(path: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line


def preprocess(args: argparse.Namespace) -> dict[str, int]:
    """Tokenize `args.input` into one indexed dataset per JSON key; returns documents per key."""
    tokenizer_kwargs = _tokenizer_kwargs(args)
    tokenizer = build_tokenizer(**tokenizer_kwargs)  # fail fast, in this process, on bad flags
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = {
        key: IndexedDatasetBuilder(f"{args.output_prefix}_{key}_document.bin", dtype=dtype)
        for key in args.json_keys
    }
    init_args = (tokenizer_kwargs, list(args.json_keys), bool(args.append_eod))
    counts = dict.fromkeys(args.json_keys, 0)
    start_s = time.monotonic()
    results: Iterator[tuple[int, dict[str, list[int]] | str, int]]
    if args.workers > 1:
        pool = multiprocessing.get_context("spawn").Pool(args.workers, _init_worker, init_args)
        results = pool.imap(_encode, _lines(args.input), chunksize=32)
    else:
        pool = None
        _init_worker(*init_args)
        results = map(_encode, _lines(args.input))
    try:
        for number, encoded, _ in results:
            if isinstance(encoded, str):
                raise PlanError(f"--input={args.input}: {encoded}")
            for key, ids in encoded.items():
                builders[key].add_document(np.asarray(ids, dtype=dtype), [len(ids)])
                counts[key] += 1
            if number % args.log_interval == 0:
                logger.info("%d documents (%.1f docs/s)", number,
                            number / max(time.monotonic() - start_s, 1e-9))
    finally:
        if pool is not None:
            pool.terminate()
    for key, builder in builders.items():
        builder.finalize(f"{args.output_prefix}_{key}_document.idx")
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[megatron_ext] %(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        sys.stderr.write(f"preprocess_data: error: --workers={args.workers} must be >= 1\n")
        return 2
    try:
        counts = preprocess(args)
    except (PlanError, OSError) as err:
        sys.stderr.write(f"preprocess_data: error: {err}\n")
        return 2
    for key, num_docs in counts.items():
        sys.stderr.write(f"wrote {args.output_prefix}_{key}_document.bin/.idx: "
                         f"{num_docs} documents\n")
    return 0
