"""Hardware profiler on 4 gloo ranks posing as 2 nodes of 2: which curves it measures, where
each group sits, that every rank gets the same profile, and the CLI under an existing group.
No speed is asserted; only the structure and the slowest-rank semantics of the timer."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ranks import this module by name

from megatron_ext.planner.profile.profiles import ClusterProfile
from megatron_ext.runtime.profile_hardware import (
    measure_seconds,
    placement,
    profile_hardware,
)
from megatron_ext.runtime.testing import run_distributed

pytestmark = pytest.mark.dist
SIZES = {"min_bytes": 2**12, "max_bytes": 2**16, "repeats": 2}


def _profile_rank(rank: int, world_size: int, out: str) -> dict:
    world = dist.group.WORLD
    cpu = torch.device("cpu")
    # the timer reports the slowest rank: rank 1 sleeps, every rank sees >= its sleep
    slow = measure_seconds(lambda: time.sleep(0.05 if rank == 1 else 0.0), world=world,
                           device=cpu, repeats=2, warmup=0)
    profile = profile_hardware(world=world, device=cpu, local_world_size=2, **SIZES)
    from megatron_ext.cli import main

    code = main(["profile", "hardware", "--out", out, "--ranks-per-node", "2",
                 "--nvlink-domain-size", "4",
                 "--min-bytes", "4096", "--max-bytes", "8192", "--repeats", "1"])
    return {"slow": slow, "profile": profile.to_dict(), "code": code}


def test_hardware_profile_structure_and_cli(tmp_path):
    out = str(tmp_path / "cluster_profile.json")
    results = run_distributed(_profile_rank, world_size=4, timeout_s=600,
                              collective_timeout_s=300, out=out)
    assert all(r["slow"] >= 0.05 for r in results)
    assert all(r["profile"] == results[0]["profile"] for r in results)  # MAX-reduced times
    assert [r["code"] for r in results] == [0] * 4
    profile = ClusterProfile.from_dict(results[0]["profile"])
    c = profile.cluster
    assert (c.num_nodes, c.gpus_per_node, c.name) == (2, 2, "measured-gloo")
    assert c.peak_flops > 0 and profile.overlap_slowdown >= 1.0
    assert 1.0 <= profile.compute_slots_per_node <= 2.0
    # collectives timed alone even when ranks share compute (their waits are compute)
    assert profile.compute_burst_s == 0.0
    # gloo moves the data on the ranks' own cores: a collective keeps part of them busy
    assert 0.0 < profile.comm_cpu_share <= 1.0
    found = {(cv.collective, cv.group_size, cv.stride): cv for cv in profile.collectives}
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    # g=2: adjacent pairs stay in a node, strided pairs (stride 2) cross; g=4 spans both nodes
    expected = {(op, 2, 1): 2 for op in ops + ("p2p",)}
    expected |= {(op, 2, 2): 1 for op in ops + ("p2p",)}
    expected |= {(op, 4, 1): 2 for op in ops}
    assert {k: cv.ranks_per_node for k, cv in found.items()} == expected
    for cv in profile.collectives:
        assert cv.num_bytes == (4096.0, 16384.0, 65536.0) and min(cv.seconds) > 0
    assert ClusterProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    from_cli = ClusterProfile.load(out)
    assert {(cv.collective, cv.group_size, cv.stride) for cv in from_cli.collectives} == set(found)
    # the NVLink domain is recorded as given (default: one node)
    assert (c.nvlink_domain, from_cli.cluster.nvlink_domain) == (2, 4)


def test_placements():
    assert placement(8, 2, strided=False) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert placement(8, 2, strided=True) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert placement(8, 4, strided=True) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert placement(4, 4, strided=True) == placement(4, 4, strided=False)
