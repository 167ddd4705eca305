"""Layerwise dynamic programme over one pipeline stage (Galvatron, VLDB'23 §4, with switch costs).

Pure numpy kernel. Table indices: u = memory units used (quantised, rounded up, so a solution the
DP accepts really fits), s = strategy of the newest layer.

  f_1[u, s] = cost[s]                                     if mem[s] <= u else inf
  f_l[u, s] = cost[s] + min_{s'} (f_{l-1}[u - mem[s], s'] + switch[s', s])
  best[l][u] = min_s f_l[u, s]   (best time of l layers within u units; "within", so monotone in u)

All layers of a stage share their costs (identical transformer layers), so one pass yields the
answer for every layer count l <= num_layers: the partitioner reads best[l][budget] directly.
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
    """[S] quantised memory per strategy."""

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
            u -= int(self.mem_units[s])
            s = prev
            out.append(s)
        return out[::-1]


def layer_dp(
    cost: np.ndarray,  # [S] seconds per layer
    mem_units: np.ndarray,  # [S] int, quantised memory per layer
    switch: np.ndarray,  # [S, S] seconds, switch[i, j] = layer i followed by layer j; 0 diagonal
    *,
    num_layers: int,
    budget_units: int,
    layout: np.ndarray | None = None,  # [S] ids; switch depends only on them, 0 inside one
    keep_choices: bool = False,
) -> StageDP:
    """Run the recurrence of the module docstring for 1..num_layers layers.

    Internally strategies are sorted by layout (a layout's members contiguous, so its minimum is
    one slice) and tables are [S, U] (shifting a strategy's row by its memory is one slice);
    choices are mapped back to the caller's indices."""
    num = len(cost)
    units = budget_units + 1
    mem_in = np.asarray(mem_units, dtype=np.int64)
    best = np.full((num_layers + 1, units), np.inf)
    best[0] = 0.0
    argbest = np.zeros((num_layers + 1, units), dtype=np.int32) if keep_choices else None
    choice = np.zeros((num_layers + 1, num, units), dtype=np.int16) if keep_choices else None
    if num == 0 or num_layers == 0:
        return StageDP(best=best, argbest=argbest, choice=choice, mem_units=mem_in)
    assert num < 2**15 and np.all(np.diag(switch) == 0), "switch[i, i] must be 0"
    groups = _Groups(switch, np.arange(num) if layout is None else np.asarray(layout))
    order = groups.order
    cost_o, mem = np.asarray(cost, dtype=float)[order], mem_in[order]
    f = np.full((num, units), np.inf)  # [S, U], sorted order
    for s in range(num):
        if mem[s] < units:
            f[s, mem[s] :] = cost_o[s]
    _record(best, argbest, f, 1, order)
    for layer in range(2, num_layers + 1):
        g, prev = groups.inner_min(f, with_arg=choice is not None)  # [S, U]
        f = np.full((num, units), np.inf)
        for s in range(num):
            if mem[s] < units:
                f[s, mem[s] :] = g[s, : units - mem[s]] + cost_o[s]
                if choice is not None:
                    choice[layer, order[s], mem[s] :] = order[prev[s, : units - mem[s]]]
        _record(best, argbest, f, layer, order)
        if not np.isfinite(best[layer, -1]):
            break
    return StageDP(best=best, argbest=argbest, choice=choice, mem_units=mem_in)


def _record(
    best: np.ndarray, argbest: np.ndarray | None, f: np.ndarray, layer: int, order: np.ndarray
) -> None:
    if argbest is not None:
        arg = np.argmin(f, axis=0)
        best[layer] = f[arg, np.arange(f.shape[1])]
        argbest[layer] = order[arg]
    else:
        best[layer] = f.min(axis=0)


class _Groups:
    """min_{s'} f[s', u] + switch[s', s] when switch[s', s] = G[layout[s'], layout[s]], G[i, i] = 0:
    first the best member of each layout, then the best layout: O(U (S + G^2)). Works on tables
    whose rows are in `order` (members of a layout contiguous)."""

    def __init__(self, switch: np.ndarray, layout: np.ndarray) -> None:
        ids, first = np.unique(layout, return_index=True)
        group = np.searchsorted(ids, layout)  # [S] dense group id
        gswitch = np.asarray(switch)[np.ix_(first, first)]  # [G, G]
        assert np.allclose(switch, gswitch[np.ix_(group, group)]), (
            "switch cost must depend only on the layout"
        )
        self.order = np.argsort(group, kind="stable")
        self.group = group[self.order]  # [S] group of each sorted row
        self.gswitch = gswitch
        self.bounds = list(zip(*np.unique(self.group, return_index=True, return_counts=True)[1:]))

    def inner_min(self, f: np.ndarray, *, with_arg: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """g[s, u] (and the sorted row index of the best predecessor). Arg-minima along axis 0
        are found as "smallest index whose value equals the minimum", which numpy vectorises
        across u, unlike argmin(axis=0)."""
        fg = np.stack([f[a : a + n].min(axis=0) for a, n in self.bounds])  # [G, U]
        total = fg[:, None, :] + self.gswitch[:, :, None]  # [G', G, U]
        gbest = total.min(axis=0)  # [G, U]
        if not with_arg:
            return gbest[self.group], None
        rows = np.arange(f.shape[0])[:, None]
        hit = np.where(f == fg[self.group], rows, f.shape[0])  # [S, U]
        argg = np.stack([hit[a : a + n].min(axis=0) for a, n in self.bounds])  # [G, U]
        gids = np.arange(len(self.bounds))[:, None, None]
        garg = np.where(total == gbest[None], gids, len(self.bounds)).min(axis=0)  # [G, U]
        prev = np.take_along_axis(argg, garg, axis=0)  # [G, U]
        return gbest[self.group], prev[self.group]
