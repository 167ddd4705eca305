"""Layerwise dynamic programme over one pipeline stage (Galvatron, VLDB'23 §4, with switch costs).

Pure numpy kernel. Table indices: u = memory units used (quantised, rounded up, so a solution the
DP accepts really fits), s = strategy of the newest layer.

  f_1[u, s] = cost[s]                                     if mem[s] <= u else inf
  f_l[u, s] = cost[s] + min_{s'} (f_{l-1}[u - mem[s], s'] + switch[s', s])
  best[l][u] = min_s f_l[u, s]   (best time of l layers within u units; "within", so monotone in u)

All layers of a stage share their costs (identical transformer layers), so one pass yields the
answer for every layer count l <= num_layers: the partitioner reads best[l][budget] directly.
Models with layers of several kinds (MoE models: dense and MoE layers) pass costs and memory per
kind ([K, S]) and the kind of each position (`kinds`); f_l then uses the l-th position's kind,
and one pass answers every layer count of stages starting where that kind sequence starts.
When the switch cost depends only on the activation layout (`layout` ids; 0 inside a layout), the
inner min runs over layouts: O(L * U * (S + G^2)) instead of O(L * U * S^2).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_ext.errors import InfeasiblePlanError


@dataclass(frozen=True, kw_only=True, slots=True)
class StageDP:
    """Result of `layer_dp`."""

    best: np.ndarray
    """[num_layers + 1, budget_units + 1]: best[l, u]; best[0, :] = 0."""
    argbest: np.ndarray | None
    """[num_layers + 1, budget_units + 1]: last layer's strategy at best[l, u] (with choices)."""
    choice: np.ndarray | None
    """[num_layers + 1, S, budget_units + 1] previous layer's strategy (with choices)."""
    mem_units: np.ndarray
    """[S] quantised memory per strategy ([K, S] with layer kinds)."""
    kinds: np.ndarray | None = None
    """[num_layers] kind of each position when mem_units is [K, S]."""

    def picks(self, num_layers: int, budget_units: int) -> list[int]:
        """Strategy index per layer of the best solution with `num_layers` layers."""
        assert self.choice is not None and self.argbest is not None, "run with keep_choices=True"
        u = int(budget_units)
        if not np.isfinite(self.best[num_layers, u]):
            raise InfeasiblePlanError(f"no assignment of {num_layers} layers fits in {u} units")
        s = int(self.argbest[num_layers, u])
        out = [s]
        for layer in range(num_layers, 1, -1):
            prev = int(self.choice[layer, s, u])
            if self.kinds is None:
                u -= int(self.mem_units[s])
            else:
                u -= int(self.mem_units[self.kinds[layer - 1], s])
            s = prev
            out.append(s)
        return out[::-1]


@dataclass(frozen=True, kw_only=True, slots=True)
class MaxSwitch:
    """Switch costs with "max" structure: switching between layouts a != b costs
    level_cost_s[max(level[a], level[b])] (the larger of the two moves), except for listed pairs
    that are cheaper. The DP then needs O((G + levels) U) per layer instead of O(G^2 U).
    Layouts are the dense ids 0..G-1 of `layer_dp`'s `layout` argument."""

    level: np.ndarray
    """[G] level of each layout."""
    level_cost_s: np.ndarray
    """[num_levels] seconds, non-decreasing."""
    exceptions: tuple[tuple[int, int, float], ...] = ()
    """(layout a, layout b, seconds) for a -> b, each no dearer than the structured cost."""

    def matrix(self) -> np.ndarray:  # [G, G]
        level = np.asarray(self.level)
        out = np.asarray(self.level_cost_s)[np.maximum(level[:, None], level[None, :])]
        np.fill_diagonal(out, 0.0)
        out = out.astype(float)
        for a, b, cost in self.exceptions:
            assert cost <= out[a, b] + 1e-15, "an exception must not be dearer than the rule"
            out[a, b] = cost
        return out


def layer_dp(
    cost: np.ndarray,  # [S] seconds per layer, or [K, S] per layer kind
    mem_units: np.ndarray,  # [S] int, quantised memory per layer, or [K, S]
    switch: np.ndarray,  # [S, S] seconds, switch[i, j] = layer i followed by layer j; 0 diagonal
    *,
    num_layers: int,
    budget_units: int,
    layout: np.ndarray | None = None,  # [S] ids; switch depends only on them, 0 inside one
    max_switch: MaxSwitch | None = None,  # the same switch costs in "max" form (needs layout)
    keep_choices: bool = False,
    groups: SwitchGroups | None = None,  # switch_groups(switch, layout, max_switch), reused
    kinds: np.ndarray | None = None,  # [>= num_layers] kind of each position ([K, S] costs)
) -> StageDP:
    """Run the recurrence of the module docstring for 1..num_layers layers.

    Internally strategies are sorted by layout (a layout's members contiguous, so its minimum is
    one slice) and tables are [S, U] (shifting a strategy's row by its memory is one slice);
    choices are mapped back to the caller's indices."""
    cost_k = np.asarray(cost, dtype=float)
    mem_in = np.asarray(mem_units, dtype=np.int64)
    per_kind = cost_k.ndim == 2
    if per_kind:
        assert kinds is not None and len(kinds) >= num_layers, "kinds needed with [K, S] costs"
        kinds = np.asarray(kinds, dtype=np.int64)[:num_layers]
    else:
        cost_k, kinds = cost_k[None], np.zeros(num_layers, dtype=np.int64)
    mem_k = mem_in if per_kind else mem_in[None]
    num = cost_k.shape[1]
    units = budget_units + 1
    best = np.full((num_layers + 1, units), np.inf)
    best[0] = 0.0
    argbest = np.zeros((num_layers + 1, units), dtype=np.int32) if keep_choices else None
    choice = np.zeros((num_layers + 1, num, units), dtype=np.int16) if keep_choices else None
    out_kinds = kinds if per_kind else None
    if num == 0 or num_layers == 0:
        return StageDP(best=best, argbest=argbest, choice=choice, mem_units=mem_in,
                       kinds=out_kinds)
    assert num < 2**15 and np.all(np.diag(switch) == 0), "switch[i, i] must be 0"
    if groups is None:
        groups = switch_groups(switch, layout, max_switch)
    order = groups.order
    cost_all, mem_all = cost_k[:, order], mem_k[:, order]
    cost_o, mem = cost_all[kinds[0]], mem_all[kinds[0]]
    f = np.full((num, units), np.inf)  # [S, U], sorted order
    for s in range(num):
        if mem[s] < units:
            f[s, mem[s] :] = cost_o[s]
    _record(best, argbest, f, 1, order)
    for layer in range(2, num_layers + 1):
        cost_o, mem = cost_all[kinds[layer - 1]], mem_all[kinds[layer - 1]]
        g, prev = groups.inner_min(f, with_arg=choice is not None)  # [S, U]
        f = np.full((num, units), np.inf)
        for s in range(num):
            if mem[s] < units:
                f[s, mem[s] :] = g[s, : units - mem[s]] + cost_o[s]
                if choice is not None:
                    assert prev is not None  # inner_min returns it when asked (with_arg)
                    choice[layer, order[s], mem[s] :] = order[prev[s, : units - mem[s]]]
        _record(best, argbest, f, layer, order)
        if not np.isfinite(best[layer, -1]):
            break
    return StageDP(best=best, argbest=argbest, choice=choice, mem_units=mem_in, kinds=out_kinds)


def _record(
    best: np.ndarray, argbest: np.ndarray | None, f: np.ndarray, layer: int, order: np.ndarray
) -> None:
    if argbest is not None:
        arg = np.argmin(f, axis=0)
        best[layer] = f[arg, np.arange(f.shape[1])]
        argbest[layer] = order[arg]
    else:
        best[layer] = f.min(axis=0)


def switch_groups(
    switch: np.ndarray, layout: np.ndarray | None, max_switch: MaxSwitch | None
) -> SwitchGroups:
    """The switch-cost structure `layer_dp` works with; build it once to run several DPs
    (other memory per layer, other budgets) over the same strategies."""
    ids = np.arange(len(switch)) if layout is None else np.asarray(layout)
    return SwitchGroups(switch, ids, max_switch)


class SwitchGroups:
    """min_{s'} f[s', u] + switch[s', s] when switch[s', s] = G[layout[s'], layout[s]], G[i, i] = 0:
    first the best member of each layout, then the best layout (dense G x G, or the MaxSwitch
    form). Works on tables whose rows are in `order` (members of a layout contiguous). Arg-minima
    along axis 0 are "smallest index whose value equals the minimum", which numpy vectorises
    across u, unlike argmin(axis=0)."""

    def __init__(
        self, switch: np.ndarray, layout: np.ndarray, max_switch: MaxSwitch | None
    ) -> None:
        ids, first = np.unique(layout, return_index=True)
        group = np.searchsorted(ids, layout)  # [S] dense group id
        gswitch = np.asarray(switch)[np.ix_(first, first)]  # [G, G]
        assert np.allclose(switch, gswitch[np.ix_(group, group)]), (
            "switch cost must depend only on the layout"
        )
        if max_switch is not None:
            assert np.allclose(max_switch.matrix(), gswitch), "max_switch must equal switch"
        self.order = np.argsort(group, kind="stable")
        self.group = group[self.order]  # [S] group of each sorted row
        self.bounds = list(zip(*np.unique(self.group, return_index=True, return_counts=True)[1:]))
        self.layouts = _MaxLayouts(max_switch) if max_switch is not None else _DenseLayouts(gswitch)

    def inner_min(self, f: np.ndarray, *, with_arg: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """g[s, u] (and the sorted row index of the best predecessor)."""
        fg = np.stack([f[a : a + n].min(axis=0) for a, n in self.bounds])  # [G, U]
        gbest, garg = self.layouts.best(fg, with_arg=with_arg)  # [G, U]
        if garg is None:
            return gbest[self.group], None
        rows = np.arange(f.shape[0])[:, None]
        hit = np.where(f == fg[self.group], rows, f.shape[0])  # [S, U]
        argg = np.stack([hit[a : a + n].min(axis=0) for a, n in self.bounds])  # [G, U]
        prev = np.take_along_axis(argg, garg, axis=0)  # [G, U]
        return gbest[self.group], prev[self.group]


def _first_index_of_min(values: np.ndarray, ids: np.ndarray, best: np.ndarray) -> np.ndarray:
    """For each column, the smallest id among rows whose value equals `best`."""
    ids = np.asarray(ids).reshape((-1,) + (1,) * (values.ndim - 1))
    return np.where(values == best[None], ids, np.iinfo(np.int64).max).min(axis=0)


class _DenseLayouts:
    """gbest[b, u] = min_a fg[a, u] + G[a, b]: O(G^2 U)."""

    def __init__(self, gswitch: np.ndarray) -> None:
        self.gswitch = gswitch

    def best(self, fg: np.ndarray, *, with_arg: bool) -> tuple[np.ndarray, np.ndarray | None]:
        total = fg[:, None, :] + self.gswitch[:, :, None]  # [G', G, U]
        gbest = total.min(axis=0)  # [G, U]
        if not with_arg:
            return gbest, None
        ids = np.arange(len(fg))
        garg = np.stack([_first_index_of_min(total[:, b], ids, gbest[b]) for b in ids])
        return gbest, garg


class _MaxLayouts:
    """The same minimum under MaxSwitch: stay (free), come from a layout of level <= mine at my
    level's cost (prefix minimum), from a higher level at its cost (suffix minimum), or through
    an exception: O((G + levels + exceptions) U)."""

    def __init__(self, ms: MaxSwitch) -> None:
        self.level = np.asarray(ms.level, dtype=np.int64)
        self.cost = np.asarray(ms.level_cost_s, dtype=float)
        assert np.all(np.diff(self.cost) >= 0), "level costs must be non-decreasing"
        self.members = [np.flatnonzero(self.level == lv) for lv in range(len(self.cost))]
        self.exceptions = ms.exceptions

    def best(self, fg: np.ndarray, *, with_arg: bool) -> tuple[np.ndarray, np.ndarray | None]:
        num_groups, units = fg.shape
        num_levels = len(self.cost)
        lev = np.full((num_levels, units), np.inf)  # best layout of each level
        lev_arg = np.zeros((num_levels, units), dtype=np.int64)
        for lv, members in enumerate(self.members):
            if len(members):
                lev[lv] = fg[members].min(axis=0)
                if with_arg:
                    lev_arg[lv] = _first_index_of_min(fg[members], members, lev[lv])
        below, below_arg = _running_min(lev, lev_arg, range(1, num_levels), -1)  # levels <= l
        lifted = lev + self.cost[:, None]
        above = np.full_like(lev, np.inf)  # levels > l, each at its own cost
        above[:-1] = lifted[1:]
        above_arg = np.zeros_like(lev_arg)
        above_arg[:-1] = lev_arg[1:]
        above, above_arg = _running_min(above, above_arg, range(num_levels - 2, -1, -1), 1)
        exc = np.full_like(fg, np.inf)
        exc_arg = np.zeros((num_groups, units), dtype=np.int64)
        for a, b, cost in self.exceptions:
            value = fg[a] + cost
            better = value < exc[b]
            exc[b] = np.where(better, value, exc[b])
            exc_arg[b] = np.where(better, a, exc_arg[b])
        level = self.level
        cands = np.stack([fg, below[level] + self.cost[level][:, None], above[level], exc])
        gbest = cands.min(axis=0)  # [G, U]
        if not with_arg:
            return gbest, None
        stay = np.broadcast_to(np.arange(num_groups)[:, None], (num_groups, units))
        args = np.stack([stay, below_arg[level], above_arg[level], exc_arg])  # [4, G, U]
        which = _first_index_of_min(cands, np.arange(4), gbest)  # [G, U] winning candidate
        return gbest, np.take_along_axis(args, which[None], axis=0)[0]


def _running_min(
    values: np.ndarray, args: np.ndarray, rows: range, step: int
) -> tuple[np.ndarray, np.ndarray]:
    """values[r] = min(values[r], values[r + step]) along `rows` (in order), with arguments."""
    values, args = values.copy(), args.copy()
    for r in rows:
        better = values[r + step] < values[r]
        values[r] = np.where(better, values[r + step], values[r])
        args[r] = np.where(better, args[r + step], args[r])
    return values, args
