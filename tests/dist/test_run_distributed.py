"""The gloo test harness itself: results, child errors, hung collectives, timeouts, cleanup.

Rank functions import only torch (no megatron); the ranks fork from the server that
tests/conftest.py preloads.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ranks import this module by name

from megatron_ext.runtime.testing import DistributedError, run_distributed  # noqa: E402

pytestmark = pytest.mark.dist


def _sum_ranks(rank: int, world_size: int, scale: int) -> dict[str, float]:
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return {"sum": value.item() * scale, "threads": torch.get_num_threads(), "rank": rank}


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 hangs here until the harness kills it


def _hang_in_collective(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.zeros(1))  # rank 1 never joins
    else:
        time.sleep(600)


def _sleep_forever(rank: int, world_size: int, pid_dir: str) -> None:
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def _where_started(rank: int, world_size: int) -> dict[str, object]:
    return {"parent": os.getppid(), "megatron_loaded": "megatron.core" in sys.modules}


def _return_unpicklable(rank: int, world_size: int) -> object:
    return lambda: None


def test_results_come_back_per_rank_with_one_thread_each() -> None:
    results = run_distributed(_sum_ranks, world_size=2, timeout_s=60, scale=10)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == 10.0 and r["threads"] == 1 for r in results)


def test_ranks_fork_from_the_preloaded_server() -> None:
    """tests/conftest.py preloads torch and megatron-core: the ranks are children of one fork
    server (not of this process), and megatron-core is imported before the rank function,
    whose module never imports it."""
    results = run_distributed(_where_started, world_size=2, timeout_s=60)
    assert len({r["parent"] for r in results}) == 1
    assert results[0]["parent"] != os.getpid()
    assert all(r["megatron_loaded"] for r in results)


def test_child_exception_surfaces_with_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(_raise_on_rank_1, world_size=2, timeout_s=60)
    message = str(info.value)
    assert "ValueError: deliberate failure on rank 1" in message
    assert "--- rank 1 ---" in message and "Traceback" in message
    assert time.monotonic() - start < 45  # not the full timeout: peers are killed on failure


def test_hung_collective_fails_within_the_collective_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedError) as info:
        run_distributed(_hang_in_collective, world_size=2, timeout_s=60, collective_timeout_s=3)
    assert "rank 0" in str(info.value)
    assert time.monotonic() - start < 45


def test_timeout_kills_every_child(tmp_path: Path) -> None:
    with pytest.raises(DistributedError, match="timed out after 20 s"):
        run_distributed(_sleep_forever, world_size=2, timeout_s=20, pid_dir=str(tmp_path))
    # A rank still importing torch at the deadline (very loaded machine) writes no pid file.
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


def test_unpicklable_result_is_an_error() -> None:
    with pytest.raises(DistributedError, match="rank"):
        run_distributed(_return_unpicklable, world_size=1, timeout_s=60)


def test_bad_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_sum_ranks, world_size=0, scale=1)
    with pytest.raises(ValueError, match="timeouts"):
        run_distributed(_sum_ranks, world_size=1, timeout_s=0, scale=1)
