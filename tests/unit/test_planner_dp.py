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
from megatron_ext.planner.cost.model import LayerCosts
from megatron_ext.planner.dp import layer_dp
from megatron_ext.planner.space import prune_strategies


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


def pruned(time_s, state, act, switch, layout):
    """The search's pruning (rules R6, to a fixed point) on bare cost components."""
    zeros = np.zeros_like(time_s)
    costs = LayerCosts(
        forward_s=time_s,
        backward_s=zeros,
        recompute_s=zeros,
        comm_s=zeros,
        grad_sync_s=zeros,
        param_gather_s=zeros,
        optimizer_s=zeros,
        state_bytes=state,
        activation_bytes=act,
        transient_bytes=zeros,
    )
    return prune_strategies(costs, time_s, switch, layout)


def test_pruning_never_changes_the_optimum():
    """Rule R6 is exact: the DP optimum over the kept strategies equals the optimum over all of
    them, for every layer count, budget and in-flight count (memory = state + inflight * act)."""
    rng = np.random.default_rng(11)
    dropped_total = 0
    for _ in range(300):
        num = int(rng.integers(2, 9))
        layout = rng.integers(0, 3, num)
        # Coarse values make ties and dominance frequent.
        time_s = rng.integers(1, 5, num).astype(float)
        state = rng.integers(0, 4, num).astype(float)
        act = rng.integers(0, 4, num).astype(float)
        g = rng.integers(0, 3, (3, 3)).astype(float) / 2
        np.fill_diagonal(g, 0.0)
        switch = g[np.ix_(layout, layout)]
        keep = pruned(time_s, state, act, switch, layout)
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


def random_max_switch(rng, num_layouts):
    from megatron_ext.planner.dp import MaxSwitch

    num_levels = int(rng.integers(1, num_layouts + 1))
    level = rng.integers(0, num_levels, num_layouts)
    cost = np.sort(rng.uniform(0.0, 0.8, num_levels))
    structured = cost[np.maximum(level[:, None], level[None, :])]
    exceptions = []
    for a, b in itertools.permutations(range(num_layouts), 2):
        if rng.random() < 0.2:
            exceptions.append((a, b, float(structured[a, b] * rng.uniform(0.0, 1.0))))
    return MaxSwitch(level=level, level_cost_s=cost, exceptions=tuple(exceptions))


def test_max_switch_form_equals_dense_and_brute_force():
    """The O(G U) "max" form of the switch costs gives the dense DP's table and valid picks."""
    rng = np.random.default_rng(13)
    for _ in range(80):
        num = int(rng.integers(1, 6))
        layout = rng.integers(0, 3, num)
        layout = np.searchsorted(np.unique(layout), layout)  # dense ids 0..G-1
        ms = random_max_switch(rng, int(layout.max()) + 1)
        switch = ms.matrix()[np.ix_(layout, layout)]
        cost = rng.uniform(0.1, 2.0, num)
        mem = rng.integers(0, 9, num)
        dense = layer_dp(cost, mem, switch, num_layers=4, budget_units=15, layout=layout)
        fast = layer_dp(
            cost,
            mem,
            switch,
            num_layers=4,
            budget_units=15,
            layout=layout,
            max_switch=ms,
            keep_choices=True,
        )
        np.testing.assert_allclose(fast.best, dense.best, rtol=1e-12)
        for n in range(1, 5):
            want = brute_force(cost, mem, switch, n, 15)
            if np.isfinite(want):
                picks = fast.picks(n, 15)
                assert solution_cost(picks, cost, switch) == pytest.approx(want, rel=1e-12)
