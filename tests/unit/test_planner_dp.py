"""Layerwise DP against a brute-force oracle, and dominance pruning against the unpruned optimum.

Random small problems (1-5 strategies, 1-5 layers, budgets 0-20 units, infeasible ones included):
every (layer count, budget) entry of the DP table must equal the enumeration of all S^L
assignments, and the backtracked picks must realise it. Equality is exact up to float summation
order (rel 1e-12).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_ext.errors import InfeasiblePlanError
from megatron_ext.planner.dp import layer_dp
from megatron_ext.planner.space import dominated, dominated_layouts


def brute_force(cost, mem, switch, num_layers, budget):
    """min over all assignments of sum cost + sum switch with sum mem <= budget (inf if none)."""
    best = np.inf
    for picks in itertools.product(range(len(cost)), repeat=num_layers):
        if sum(mem[s] for s in picks) > budget:
            continue
        total = sum(cost[s] for s in picks) + sum(
            switch[a, b] for a, b in itertools.pairwise(picks)
        )
        best = min(best, total)
    return best


def solution_cost(picks, cost, switch):
    return sum(cost[s] for s in picks) + sum(switch[a, b] for a, b in itertools.pairwise(picks))


def random_problem(rng, *, grouped: bool):
    num = int(rng.integers(1, 6))
    cost = rng.uniform(0.1, 2.0, num)
    mem = rng.integers(0, 9, num)
    if grouped:
        layout = rng.integers(0, 3, num)
        g = rng.uniform(0.0, 0.8, (3, 3))
        np.fill_diagonal(g, 0.0)
        switch = g[np.ix_(layout, layout)]
    else:
        layout = None
        switch = rng.uniform(0.0, 0.8, (num, num))
        np.fill_diagonal(switch, 0.0)
    return cost, mem, switch, layout


@pytest.mark.parametrize("grouped", [False, True])
def test_dp_equals_brute_force(grouped):
    rng = np.random.default_rng(7 + grouped)
    infeasible_seen = 0
    for _ in range(120):
        cost, mem, switch, layout = random_problem(rng, grouped=grouped)
        num_layers = int(rng.integers(1, 6)) if len(cost) < 5 else int(rng.integers(1, 5))
        budget = int(rng.integers(0, 21))
        dp = layer_dp(
            cost,
            mem,
            switch,
            num_layers=num_layers,
            budget_units=budget,
            layout=layout,
            keep_choices=True,
        )
        for n in range(1, num_layers + 1):
            for u in range(budget + 1):
                want = brute_force(cost, mem, switch, n, u)
                got = dp.best[n, u]
                if np.isinf(want):
                    infeasible_seen += 1
                    assert np.isinf(got)
                    with pytest.raises(InfeasiblePlanError):
                        dp.picks(n, u)
                    continue
                assert got == pytest.approx(want, rel=1e-12)
                picks = dp.picks(n, u)
                assert len(picks) == n
                assert sum(mem[s] for s in picks) <= u
                assert solution_cost(picks, cost, switch) == pytest.approx(want, rel=1e-12)
    assert infeasible_seen > 0


def test_dp_without_choices_matches_with_choices():
    rng = np.random.default_rng(3)
    for _ in range(30):
        cost, mem, switch, layout = random_problem(rng, grouped=True)
        a = layer_dp(cost, mem, switch, num_layers=4, budget_units=15, layout=layout)
        b = layer_dp(
            cost, mem, switch, num_layers=4, budget_units=15, layout=layout, keep_choices=True
        )
        np.testing.assert_array_equal(a.best, b.best)


def pruned(comps, switch, layout):
    """The search's two pruning passes (search.prune_strategies without the cost model)."""
    keep = []
    for lay in np.unique(layout):
        members = np.flatnonzero(layout == lay)
        drop = dominated(comps[members], np.zeros((len(members), len(members))))
        keep += members[~drop].tolist()
    keep = np.array(sorted(keep))
    keep = keep[~dominated_layouts(comps[keep], switch[np.ix_(keep, keep)], layout[keep])]
    return keep[~dominated(comps[keep], switch[np.ix_(keep, keep)])]


def test_pruning_never_changes_the_optimum():
    """Rule R6 is exact: the DP optimum over the kept strategies equals the optimum over all of
    them, for every layer count, budget and in-flight count (memory = state + inflight * act)."""
    rng = np.random.default_rng(11)
    dropped_total = 0
    for _ in range(150):
        num = int(rng.integers(2, 9))
        layout = rng.integers(0, 3, num)
        # Coarse values make ties and dominance frequent.
        time_s = rng.integers(1, 5, num).astype(float)
        state = rng.integers(0, 4, num).astype(float)
        act = rng.integers(0, 4, num).astype(float)
        g = rng.integers(0, 3, (3, 3)).astype(float) / 2
        np.fill_diagonal(g, 0.0)
        switch = g[np.ix_(layout, layout)]
        keep = pruned(np.stack([time_s, state, act], axis=1), switch, layout)
        dropped_total += num - len(keep)
        for inflight in (1, 3):
            mem = (state + inflight * act).astype(np.int64)
            full = layer_dp(time_s, mem, switch, num_layers=4, budget_units=20, layout=layout)
            sub = layer_dp(
                time_s[keep],
                mem[keep],
                switch[np.ix_(keep, keep)],
                num_layers=4,
                budget_units=20,
                layout=layout[keep],
            )
            np.testing.assert_allclose(sub.best, full.best, rtol=1e-12)
    assert dropped_total > 100  # the rules actually fire on these problems
