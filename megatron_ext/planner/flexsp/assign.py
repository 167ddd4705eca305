"""Sequence-to-group assignment for one micro-batch and one group multiset (fast planner core).

Three phases, all on the FlexSP cost model (cost.py), sequences sorted by descending length:
1. `_lpt`: the long ("big") sequences one by one to the group where they finish earliest
   (longest-processing-time first on uniform machines; one min-heap of groups per degree, so a
   step checks one candidate per degree), respecting min degree and group memory;
2. `water_fill`: the short sequences in bulk: water-fill the groups to a common finishing level with
   prefix sums + searchsorted (a run of consecutive short sequences per group), leftovers by (1);
3. `refine`: local search on the slowest group: best single move, else best swap with any other
   group, until the slowest group cannot be improved. Vectorised over candidates with numpy.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

_EPS = 1e-12
TAIL_PER_GROUP = 2
"""Short sequences per group left to earliest-finish-time after water-filling."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchProblem:
    """One micro-batch's sequences (descending length) with per-degree costs precomputed."""

    lengths: np.ndarray
    """[K] int64 token lengths, descending."""
    times: np.ndarray
    """[K, num_deg] seconds of each sequence alone in a group of each degree (no latency)."""
    min_deg_idx: np.ndarray
    """[K] index of each sequence's smallest degree that holds it."""
    degrees: np.ndarray
    """[num_deg] candidate degrees, ascending."""
    latency_s: np.ndarray
    """[num_deg] all-to-all latency a non-empty group of each degree pays."""
    capacity_tokens: int
    """Tokens one device holds; a group of degree d holds d times as many."""
    rows: list[list[float]] = field(default_factory=list)
    """`times` as Python lists (the per-sequence loops read them); filled in __post_init__."""
    length_list: list[int] = field(default_factory=list)
    """`lengths` as a Python list."""
    min_deg_list: list[int] = field(default_factory=list)
    """`min_deg_idx` as a Python list."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", self.times.tolist())
        object.__setattr__(self, "length_list", self.lengths.tolist())
        object.__setattr__(self, "min_deg_list", self.min_deg_idx.tolist())


@dataclass(kw_only=True, slots=True)
class Assignment:
    """Mutable result of assigning a problem's sequences to concrete groups."""

    group_deg_idx: np.ndarray
    """[G] degree index of each group, groups in descending degree order (aligned placement)."""
    seq_group: np.ndarray
    """[K] group of each sequence."""
    loads: np.ndarray
    """[G] predicted group times (with latency, without the fixed per-micro-batch term)."""
    tokens: np.ndarray
    """[G] tokens per group."""

    @property
    def makespan_s(self) -> float:
        return float(self.loads.max()) if self.loads.size else 0.0


def groups_of(counts: np.ndarray) -> np.ndarray:
    """Degree index per group (descending degree): counts [num_deg] -> [G]."""
    idx = np.arange(counts.size)[::-1]
    return np.repeat(idx, counts[::-1]).astype(np.int64)


def assign(problem: MicroBatchProblem, counts: np.ndarray, num_big: int) -> Assignment | None:
    """Assign every sequence to a group of the multiset `counts`; None if memory forbids it."""
    group_j = groups_of(counts)
    num_groups = group_j.size
    state = Assignment(
        group_deg_idx=group_j,
        seq_group=np.full(problem.lengths.size, -1, dtype=np.int64),
        loads=np.zeros(num_groups),
        tokens=np.zeros(num_groups, dtype=np.int64),
    )
    if not _lpt(problem, state, list(range(num_big))):
        return None
    if not water_fill(problem, state, num_big):
        return None
    return state


def _lpt(problem: MicroBatchProblem, state: Assignment, seqs: list[int]) -> bool:
    """Earliest-finish-time placement of `seqs` in the given order. False if one does not fit."""
    num_deg = problem.degrees.size
    group_j = state.group_deg_idx.tolist()
    loads, tokens = state.loads.tolist(), state.tokens.tolist()
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(num_deg)]
    for g, j in enumerate(group_j):
        heaps[j].append((loads[g], g))
    for h in heaps:
        heapq.heapify(h)
    group_cap = [int(problem.capacity_tokens * problem.degrees[j]) for j in range(num_deg)]
    lat = problem.latency_s.tolist()
    rows, lengths, jmin = problem.rows, problem.length_list, problem.min_deg_list
    placed: list[int] = []
    present = [j for j in range(num_deg) if heaps[j]]  # degrees of the multiset, ascending
    for k in seqs:
        row, length, jk = rows[k], lengths[k], jmin[k]
        best_fin, best_g, best_j = float("inf"), -1, -1
        for j in present:
            if j < jk:
                continue
            heap = heaps[j]
            g = heap[0][1]
            if tokens[g] + length > group_cap[j]:  # rare: scan this degree for room
                fits = [g2 for _, g2 in heap if tokens[g2] + length <= group_cap[j]]
                if not fits:
                    continue
                g = min(fits, key=loads.__getitem__)
            fin = loads[g] + row[j] + (lat[j] if tokens[g] == 0 else 0.0)
            if fin < best_fin - _EPS:
                best_fin, best_g, best_j = fin, g, j
        if best_g < 0:
            return False
        loads[best_g] = best_fin
        tokens[best_g] += length
        placed.append(best_g)
        heap = heaps[best_j]
        if heap[0][1] == best_g:
            heapq.heapreplace(heap, (best_fin, best_g))
        else:
            heaps[best_j] = [(loads[g], g) for _, g in heap]
            heapq.heapify(heaps[best_j])
    state.seq_group[seqs] = placed
    state.loads = np.asarray(loads)
    state.tokens = np.asarray(tokens, dtype=np.int64)
    return True


def _water_level(loads: np.ndarray, weights: np.ndarray, work: float) -> float:
    """Level C with sum_g weights_g * max(0, C - loads_g) = work (weights > 0)."""
    order = np.argsort(loads)
    lo, w = loads[order], weights[order]
    cum_w, cum_lw = np.cumsum(w), np.cumsum(w * lo)
    levels = (work + cum_lw) / cum_w  # level if the first i+1 groups are below it
    nxt = np.append(lo[1:], np.inf)
    i = int(np.argmax(levels <= nxt))
    return float(levels[i])


def water_fill(problem: MicroBatchProblem, state: Assignment, start: int) -> bool:
    """Assign sequences [start, K) (short ones) by water-filling; leftovers by `_lpt`.

    All short sequences together raise the groups to a common level (each degree at its own
    speed); the groups of one degree then take consecutive runs of the sorted short sequences,
    cut where the cumulative time crosses their cumulative quota (rounded to the nearer cut).
    """
    n_all = problem.lengths.size - start
    if n_all <= 0:
        return True
    # the shortest TAIL_PER_GROUP * G sequences are kept back for earliest-finish-time, which
    # evens out the water-filling's rounding with items smaller than any it made
    n = n_all - min(n_all // 2, TAIL_PER_GROUP * state.group_deg_idx.size)
    small_t = problem.times[start:start + n]  # [n, num_deg]
    prefix = np.vstack([np.zeros((1, small_t.shape[1])), np.cumsum(small_t, axis=0)])  # [n+1, nd]
    prefix_tok = np.concatenate([[0], np.cumsum(problem.lengths[start:start + n])])  # [n+1]
    ratio = prefix[-1] / max(prefix[-1, 0], _EPS)  # time at degree j / time at degree 0
    group_j = state.group_deg_idx
    level = _water_level(state.loads, 1.0 / ratio[group_j], float(prefix[-1, 0]))
    quota = np.maximum(level - state.loads, 0.0)
    group_cap = problem.capacity_tokens * problem.degrees[group_j]
    p = 0
    for j in np.unique(group_j)[::-1].tolist():
        gs = np.flatnonzero((group_j == j) & (quota > 0))
        if p >= n or gs.size == 0:
            continue
        gs = gs[np.argsort(-quota[gs], kind="stable")]
        col = prefix[:, j]
        targets = col[p] + np.cumsum(quota[gs])  # [len(gs)] cumulative cut targets
        ends = np.searchsorted(col, targets, side="right") - 1
        up = np.minimum(ends + 1, n)
        ends = np.where(col[up] - targets < targets - col[ends], up, ends)
        ends = np.maximum.accumulate(np.maximum(ends, p))
        starts = np.concatenate([[p], ends[:-1]])
        tok = prefix_tok[ends] - prefix_tok[starts]
        if np.any(state.tokens[gs] + tok > group_cap[gs]):
            return _lpt(problem, state, list(range(start + p, start + n_all)))  # memory-tight
        state.seq_group[start + p:start + ends[-1]] = np.repeat(gs, ends - starts)
        opened = (state.tokens[gs] == 0) & (ends > starts)
        state.loads[gs] += col[ends] - col[starts] + opened * problem.latency_s[j]
        state.tokens[gs] += tok
        p = int(ends[-1])
    return _lpt(problem, state, list(range(start + p, start + n_all)))
