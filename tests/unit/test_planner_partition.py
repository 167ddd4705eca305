"""Pipeline partition: the exact partitioner against enumeration, and never worse than BMW."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_ext.planner.partition import (
    best_partition,
    bmw_partition,
    partition_objective,
)


def compositions(total, parts):
    """All (n_0, ..., n_{p-1}) with n_k >= 1 summing to total."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [b - a for a, b in itertools.pairwise(bounds)]


def random_slots(rng, pp, num_layers):
    """Monotone slot times like the DP produces, with a memory cap (inf) per stage."""
    per_layer = rng.uniform(0.5, 1.5, pp)
    fixed = rng.uniform(0.0, 3.0, pp)
    slot = fixed[:, None] + per_layer[:, None] * np.arange(num_layers + 1)[None, :]
    for k in range(pp):
        cap = int(rng.integers(1, num_layers + 1))
        slot[k, cap + 1 :] = np.inf
    return slot


def test_exact_partition_equals_brute_force_and_beats_bmw():
    rng = np.random.default_rng(5)
    infeasible = 0
    for _ in range(300):
        pp = int(rng.integers(1, 5))
        num_layers = int(rng.integers(pp, 10))
        m = int(rng.integers(1, 9))
        slot = random_slots(rng, pp, num_layers)
        want = min(
            (partition_objective(slot, c, m) for c in compositions(num_layers, pp)), default=np.inf
        )
        got = best_partition(slot, num_layers, m)
        bmw = bmw_partition(slot, num_layers, m)
        if not np.isfinite(want):
            infeasible += 1
            assert got is None and bmw is None
            continue
        assert got is not None
        assert got[0] == pytest.approx(want, rel=1e-12)
        assert sum(got[1]) == num_layers and min(got[1]) >= 1
        assert partition_objective(slot, got[1], m) == pytest.approx(got[0], rel=1e-12)
        if bmw is not None:  # BMW may also fail to find a feasible start; never better
            assert bmw[0] >= got[0] - 1e-9
    assert infeasible > 0
