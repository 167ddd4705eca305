"""Power-of-two group multisets and their lower bounds (the fast planner's outer loop).

A multiset is a count vector n[j] of groups of degree degrees[j] with sum_j n[j]*degrees[j] = N.
Placing groups in descending degree order gives every group an aligned contiguous rank range,
so a group of degree <= gpus_per_node (a power of two) stays inside one node (FlexSP §3 fn. 4).

For N=64 and degrees 1..32 there are 1,827 multisets; the planner bounds each degree's count by
how many sequences could use such a group (`count_bounds`) and scores all of them at once with
`lower_bounds`, a valid lower bound on the makespan of the best assignment.
"""

from __future__ import annotations

import numpy as np


def enumerate_multisets(
    num_gpus: int, degrees: tuple[int, ...], max_counts: tuple[int, ...] | None = None
) -> np.ndarray:
    """All count vectors (int64, [num_multisets, num_degrees]) with sum n*degree = num_gpus.

    `max_counts[j]` caps n[j] for every degree but the smallest, which fills the remainder
    (the remainder must be a multiple of it). Vectorised: one np.repeat per degree.
    """
    num_deg = len(degrees)
    rows = np.zeros((1, num_deg), dtype=np.int64)  # [num_rows, num_deg]
    remaining = np.array([num_gpus], dtype=np.int64)  # [num_rows]
    for j in range(num_deg - 1, 0, -1):
        limit = remaining // degrees[j]
        if max_counts is not None:
            limit = np.minimum(limit, max_counts[j])
        reps = limit + 1
        rows = np.repeat(rows, reps, axis=0)
        remaining = np.repeat(remaining, reps)
        starts = np.cumsum(reps) - reps
        counts = np.arange(rows.shape[0]) - np.repeat(starts, reps)
        rows[:, j] = counts
        remaining = remaining - counts * degrees[j]
    ok = remaining % degrees[0] == 0
    rows, remaining = rows[ok], remaining[ok]
    rows[:, 0] = remaining // degrees[0]
    return rows


GRID_TOP = 256
"""Multisets (best plain bounds first) that also get the parametric bound."""


def count_multisets(num_gpus: int, degrees: tuple[int, ...],
                    max_counts: tuple[int, ...] | None = None) -> int:
    """How many rows `enumerate_multisets` would return (DP over degrees, O(num_deg * N))."""
    ways = np.zeros(num_gpus + 1, dtype=np.float64)  # ways[r]: r devices left for smaller ones
    ways[num_gpus] = 1.0
    for j in range(len(degrees) - 1, 0, -1):
        limit = max_counts[j] if max_counts is not None else num_gpus
        new = np.zeros_like(ways)
        for n in range(min(limit, num_gpus // degrees[j]) + 1):
            shift = n * degrees[j]
            new[: num_gpus + 1 - shift] += ways[shift:]
        ways = new
    return int(ways[:: degrees[0]].sum()) if degrees[0] > 1 else int(ways.sum())


def fit_caps(num_gpus: int, degrees: tuple[int, ...], caps: tuple[int, ...],
             max_rows: int) -> tuple[int, ...]:
    """Shrink `caps` (all but the smallest degree, proportionally) until at most `max_rows`
    multisets remain; the homogeneous multisets are added back by the caller."""
    caps = tuple(min(c, num_gpus // d) for c, d in zip(caps, degrees))
    while count_multisets(num_gpus, degrees, caps) > max_rows and any(caps[1:]):
        caps = (caps[0],) + tuple(int(c * 0.7) for c in caps[1:])
    return caps


def lower_bounds(
    counts: np.ndarray,  # [num_multisets, num_deg]
    degrees: np.ndarray,  # [num_deg]
    times: np.ndarray,  # [num_seqs, num_deg]: time of each sequence alone at each degree
    min_deg_idx: np.ndarray,  # [num_seqs]: index of each sequence's smallest feasible degree
    lengths: np.ndarray,  # [num_seqs], descending
    capacity_tokens: int,
    num_grid: int = 24,
) -> np.ndarray:  # [num_multisets], +inf where memory makes the multiset infeasible
    """A valid lower bound on each multiset's makespan (without the fixed per-micro-batch term).

    Parametric work bound: if makespan C is achievable, every sequence s runs in a group whose
    degree d has t_d(s) <= C (a group is at least as slow as any one of its sequences), so s needs
    degree >= req(s, C) and costs at least gpu_s(s, req) GPU-seconds (GPU-seconds grow with the
    degree: more all-to-all). The sequences with req >= degrees[j] must fit, in GPU-seconds and
    in tokens, into the G_j devices of groups of degree >= degrees[j]:
        W_j(C) <= C * G_j  and  tokens_j(C) <= capacity * G_j  for every j.
    Feasibility is monotone in C; it is tested on a geometric grid of C and the bound is the
    largest grid point that fails (plus the exact C = +inf case, the plain work/memory bound).
    Item bound: the longest sequence needs one present degree that can hold it.
    """
    num_deg = len(degrees)
    gpus_at_least = np.cumsum((counts * degrees)[:, ::-1], axis=1)[:, ::-1]  # [M, num_deg]
    allowed = np.arange(num_deg)[None, :] >= min_deg_idx[:, None]  # [K, num_deg]
    gpu_s = times * degrees  # [K, num_deg]
    bound = np.zeros(counts.shape[0])
    for j in range(num_deg):  # C = +inf: plain work and memory bound
        need = min_deg_idx >= j
        if not need.any():
            break
        work = gpu_s[need, np.maximum(min_deg_idx[need], j)].sum()
        g = gpus_at_least[:, j]
        bound = np.maximum(bound, work / np.maximum(g, 1))
        bound[g * capacity_tokens < lengths[need].sum()] = np.inf
    present = counts > 0  # [M, num_deg]
    best_single = np.where(present & allowed[0], times[0], np.inf).min(axis=1)  # [M]
    bound = np.maximum(bound, best_single)
    # pigeonhole: with G groups, two of the G+1 longest sequences share a group, which takes at
    # least the two shortest of them at its degree (times grow with length)
    num_groups = counts.sum(axis=1)  # [M]
    pair = num_groups < lengths.size
    if pair.any():
        g = num_groups[pair]
        two = times[g - 1] + times[g]  # [M', num_deg]
        ok = present[pair] & allowed[g]  # the shorter one's degree holds both
        bound[pair] = np.maximum(bound[pair], np.where(ok, two, np.inf).min(axis=1))
    # the parametric bound only for the GRID_TOP multisets with the best plain bounds: it
    # reorders the promising ones; the others keep their (valid, weaker) plain bound
    top = np.argsort(bound, kind="stable")[:GRID_TOP]
    top = top[np.isfinite(bound[top])]
    if top.size:
        lo, hi = bound[top].min(), bound[top].max() * 4
        grid = np.geomspace(lo, hi, num_grid)  # [num_grid]
        fails = _grid_infeasible(grid, gpus_at_least[top], times, gpu_s, allowed, lengths,
                                 capacity_tokens)  # [top, num_grid]
        # largest failing grid point below the first feasible one (feasibility is monotone)
        last_fail = np.where(fails.all(axis=1), num_grid - 1, np.argmin(fails, axis=1) - 1)
        grid_bound = np.where(last_fail >= 0, grid[np.maximum(last_fail, 0)], 0.0)
        bound[top] = np.maximum(bound[top], grid_bound)
    return bound


def _grid_infeasible(
    grid: np.ndarray,  # [num_grid]
    gpus_at_least: np.ndarray,  # [M, num_deg]
    times: np.ndarray,  # [K, num_deg]
    gpu_s: np.ndarray,  # [K, num_deg]
    allowed: np.ndarray,  # [K, num_deg]
    lengths: np.ndarray,  # [K]
    capacity_tokens: int,
) -> np.ndarray:  # [M, num_grid] True where makespan grid[i] is impossible
    num_deg = times.shape[1]
    # sequences already fast enough at their smallest degree for every grid point keep req=jmin
    jmin = np.argmax(allowed, axis=1)  # [K]
    t_min = times[np.arange(times.shape[0]), jmin]  # [K]
    var = t_min > grid[0]  # [K]; lengths are descending, so a prefix
    fixed_req = jmin[~var]
    fixed_gpu_s = gpu_s[np.flatnonzero(~var), fixed_req]
    fast = (times[var, :, None] <= grid[None, None, :]) & allowed[var, :, None]  # [V, nd, grid]
    possible = fast.any(axis=1).all(axis=0)  # [grid]: every sequence has some degree
    req = np.argmax(fast, axis=1)  # [V, grid]
    req_gpu_s = np.take_along_axis(gpu_s[var], req, axis=1)  # [V, grid]
    fails = np.broadcast_to(~possible, (gpus_at_least.shape[0], grid.size)).copy()
    var_len, fixed_len = lengths[var], lengths[~var]
    for j in range(num_deg):
        mask = req >= j  # [V, grid]
        keep = fixed_req >= j
        work = (req_gpu_s * mask).sum(axis=0) + fixed_gpu_s[keep].sum()  # [grid]
        tokens = (var_len[:, None] * mask).sum(axis=0) + fixed_len[keep].sum()  # [grid]
        g = gpus_at_least[:, j : j + 1]  # [M, 1]
        fails |= (work[None, :] > grid[None, :] * g * (1 + 1e-9)) | (
            tokens[None, :] > capacity_tokens * g)
    return fails
