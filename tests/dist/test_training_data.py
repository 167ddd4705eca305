"""The sample order of the training loop does not depend on the plan, and resumes exactly.

Global batch k holds samples [k*gbs, (k+1)*gbs); each micro-batch of `plan.micro_batch_size`
consecutive samples is cut into `DataShard.count` equal slices. So the union over ranks, in rank
order, is the same sequence for every data-parallel degree, and starting from `consumed` yields
exactly the tail of an uninterrupted iterator. (No process group needed: plain iterators.)
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_ext.megatron_adapter.training.data import DataShard, MicroBatchIterator


class _Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return {"tokens": torch.tensor([idx])}


def _global_order(dp: int, consumed: int, num_micro_batches: int) -> list[int]:
    shards = [MicroBatchIterator(_Samples(), consumed=consumed, global_micro_batch=8,
                                 shard=DataShard(index=r, count=dp)) for r in range(dp)]
    order = []
    for _ in range(num_micro_batches):
        for it in shards:  # rank order within one micro-batch
            order += next(it)["tokens"].view(-1).tolist()
    return order


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_order_is_plan_independent(dp: int) -> None:
    assert _global_order(dp, consumed=0, num_micro_batches=6) == list(range(48))


def test_resume_from_consumed_continues_the_sequence() -> None:
    assert _global_order(4, consumed=40, num_micro_batches=3) == list(range(40, 64))


def test_consumed_counts_all_replicas_and_the_end_stops() -> None:
    it = MicroBatchIterator(_Samples(), consumed=80, global_micro_batch=8,
                            shard=DataShard(index=1, count=2))
    batches = list(itertools.islice(it, 5))
    assert [b["tokens"].view(-1).tolist() for b in batches] == [[84, 85, 86, 87], [92, 93, 94, 95]]
    assert it.consumed == 96


def test_cyclic_wraps_for_validation() -> None:
    it = MicroBatchIterator(_Samples(), consumed=88, global_micro_batch=8,
                            shard=DataShard(index=0, count=1), cyclic=True)
    assert [next(it)["tokens"].view(-1).tolist() for _ in range(2)] == [
        list(range(88, 96)), list(range(8))]
