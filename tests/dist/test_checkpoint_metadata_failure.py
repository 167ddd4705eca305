"""A save whose `.metadata` write fails on the coordinator ends on every rank, without a hang.

megatron-core's finalize lets the coordinator write `.metadata` and then broadcasts whether any
rank failed; a failing metadata write raised before that broadcast and left the other ranks
waiting in it (seen as a hang of the async full-disk test when the disk filled at exactly that
write). `checkpoint_write.save_strategy` keeps the coordinator's error until the broadcast is
done and `save` returned (`raise_kept_error`). Here rank 0's metadata write fails with ENOSPC on
2 gloo ranks: rank 0 raises it after `save`, rank 1 returns, and `agree` gives both the error.
"""

from __future__ import annotations

import errno
import warnings
from pathlib import Path

import pytest

from megatron_ext.runtime.testing import run_distributed

pytestmark = pytest.mark.dist


def _save(rank: int, world_size: int, *, root: str) -> dict:
    warnings.filterwarnings("ignore")
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_ext.megatron_adapter.build import prepare_megatron
    from megatron_ext.megatron_adapter.training import checkpoint_write

    prepare_megatron()
    if rank == 0:
        def full_disk(self, *args, **kwargs):  # the metadata write of the coordinator
            raise OSError(errno.ENOSPC, "No space left on device")
        filesystem_async.FileSystemWriterAsync.finish = full_disk
    weight = torch.arange(8.0) + 8 * rank
    sd = {"w": ShardedTensor.from_rank_offsets("w", weight, (0, rank, world_size),
                                               replica_id=0)}
    strategy = checkpoint_write.save_strategy(cached=False)
    error = None
    try:
        dist_checkpointing.save(sd, root, sharded_strategy=strategy)  # all its collectives run
        strategy.raise_kept_error()
    except checkpoint_write.SAVE_ERRORS as err:
        error = checkpoint_write.cause_of(err, Path(root))
    return {"error": error, "agreed": checkpoint_write.agree(error)}


def test_failed_metadata_write_ends_the_save_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "iter_0000004.tmp"
    root.mkdir()
    results = run_distributed(_save, world_size=2, timeout_s=300, root=str(root))
    assert results[0]["error"] == "No space left on device (ENOSPC)", results
    assert results[1]["error"] is None, results  # its shards were written; rank 0 failed
    assert results[0]["agreed"] == results[1]["agreed"] == results[0]["error"]
