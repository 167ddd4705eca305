"""Datasets and resumable micro-batch iterators, as Megatron-LM's pretrain_gpt.py builds them.

Legend: b = samples in one rank's micro-batch, s = seq_length.

Datasets come from megatron-core's `BlendedMegatronDatasetBuilder` over `GPTDataset`
(`--data-path` with optional weights and `--split`, or `--train/valid/test-data-path`) or
`MockGPTDataset` (`--mock-data`). The sample order is Megatron's: global batch k of the run holds
samples [k*gbs, (k+1)*gbs) of the train dataset, cut into micro-batches of `plan.micro_batch_size`
consecutive samples (all data-parallel replicas together); a rank reads only its `DataShard` of each
micro-batch. The order therefore does not depend on the plan, and a run resumed from
`consumed_samples` under any plan sees exactly the samples the uninterrupted run would have.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import get_blend_from_list

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.training.run_config import RunConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataShard:
    """Which part of every global micro-batch this rank reads."""

    index: int
    """Position of this rank's slice, 0 <= index < count."""
    count: int
    """Equal slices a global micro-batch is cut into (Megatron: the data-parallel size)."""

    def rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This slice's rows of a global micro-batch of `[b, ...]` tensors: what
        `MicroBatchIterator` reads for this rank."""
        size = next(iter(batch.values())).shape[0] // self.count
        return {key: value[self.index * size:(self.index + 1) * size]
                for key, value in batch.items()}


def train_valid_test_num_samples(run: RunConfig) -> list[int]:
    """Megatron-LM's sample counts (training.py get_train_valid_test_num_samples): the run's
    train samples, and eval_iters x gbs per evaluation."""
    sched, gbs = run.schedule, run.batch.global_batch_size
    eval_interval = sched.eval_interval or sched.train_iters
    num_evals = sched.train_iters // eval_interval + 1
    return [sched.train_samples, num_evals * sched.eval_iters * gbs, sched.eval_iters * gbs]


def _blend(paths: tuple[str, ...] | None) -> Any:
    return get_blend_from_list(list(paths)) if paths else None


def dataset_config(run: RunConfig, tokenizer: Any) -> GPTDatasetConfig:
    """GPTDatasetConfig from the run (Megatron-LM's `core_gpt_dataset_config_from_args`)."""
    data = run.data
    per_split = (data.train_data_path, data.valid_data_path, data.test_data_path)
    blend_per_split = [_blend(p) for p in per_split] if any(per_split) else None
    blend = None if blend_per_split else _blend(data.data_path)
    if not data.mock_data and blend is None and blend_per_split is None:
        raise PlanError("no training data: give --data-path PREFIX (or --train-data-path ...) "
                        "or --mock-data")
    if blend is not None and blend_per_split is not None:
        raise PlanError("--data-path and --train/valid/test-data-path are exclusive; give one")
    return GPTDatasetConfig(
        random_seed=run.system.seed,
        sequence_length=run.batch.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=data.split if blend is not None else None,
        path_to_cache=data.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=True,
        mmap_bin_files=data.mmap_bin_files,
    )


def check_prefixes_exist(config: GPTDatasetConfig) -> None:
    blends = [config.blend] if config.blend is not None else (config.blend_per_split or [])
    for blend in blends:
        for prefix in (blend[0] if blend is not None else []):
            missing = [ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
            if missing:
                raise PlanError(f"data prefix {prefix}: {prefix}{missing[0]} does not exist; give "
                                "the --output-prefix of tools/preprocess_data.py plus "
                                 "_text_document")


def check_split_not_empty(config: GPTDatasetConfig) -> None:
    """megatron-core 0.16.1 loops forever building a split that has a non-zero weight but gets
    no document after rounding (gpt_dataset.py `_get_num_epochs` with 0 tokens per epoch)."""
    if config.blend is None or config.split_matrix is None:
        return
    for prefix in config.blend[0]:
        num_docs = len(IndexedDataset(prefix).sequence_lengths)
        for name, bounds in zip(("train", "valid", "test"), config.split_matrix):
            if bounds is None:
                continue
            first, end = (round(b * num_docs) for b in bounds)
            if end == first:
                raise PlanError(
                    f"--split={config.split} leaves the {name} split of {prefix} "
                    f"({num_docs} documents) empty; give it weight 0 or more data (e.g. 90,10,0)")


def build_datasets(run: RunConfig, tokenizer: Any) -> list[Any]:
    """[train, valid, test] datasets (None where a split is empty), built on every rank."""
    config = dataset_config(run, tokenizer)
    cls = MockGPTDataset if run.data.mock_data else GPTDataset
    try:
        if not run.data.mock_data:
            check_prefixes_exist(config)
            check_split_not_empty(config)
        return BlendedMegatronDatasetBuilder(
            cls, train_valid_test_num_samples(run), lambda: True, config
        ).build()
    except FileNotFoundError as err:
        raise PlanError(f"--data-path: {err}; give the prefix written by "
                        "tools/preprocess_data.py (without .bin/.idx)") from None


def _collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}  # [b, ...]


def _sample_indices(
    consumed: int, global_micro_batch: int, shard: DataShard, num_samples: int, cyclic: bool
) -> Iterator[list[int]]:
    if global_micro_batch % shard.count:
        raise PlanError(f"micro-batch of {global_micro_batch} samples does not split over "
                        f"{shard.count} data-parallel replicas")
    local = global_micro_batch // shard.count
    start = consumed
    while True:
        first = start + shard.index * local
        indices = list(range(first, first + local))
        if indices[-1] >= num_samples:
            if not cyclic:
                return
            indices = [i % num_samples for i in indices]
        yield indices
        start += global_micro_batch


class MicroBatchIterator:
    """Yields this rank's part of consecutive global micro-batches, from `consumed` samples on.

    `consumed` counts samples of all replicas together, so it is the same on every rank and is
    what checkpoints store. `num_workers` > 0 prefetches with torch DataLoader workers.
    """

    def __init__(self, dataset: Any, *, consumed: int, global_micro_batch: int, shard: DataShard,
                 num_workers: int = 0, cyclic: bool = False) -> None:
        self.consumed = consumed
        self._global_micro_batch = global_micro_batch
        batches = _sample_indices(consumed, global_micro_batch, shard, len(dataset), cyclic)
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=_ListSampler(batches), collate_fn=_collate,
            num_workers=num_workers, persistent_workers=num_workers > 0,
            # Its own generator: the default one drives dropout and must see the same draws in
            # a resumed run as in the uninterrupted one (iter() would draw a worker seed from it).
            generator=torch.Generator().manual_seed(0),
        )
        self._it = iter(loader)

    def __iter__(self) -> MicroBatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self._it)
        self.consumed += self._global_micro_batch
        return batch


class _ListSampler(torch.utils.data.Sampler):
    """A batch sampler over a (possibly infinite) generator of index lists."""

    def __init__(self, batches: Iterator[list[int]]) -> None:
        self._batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return self._batches
