"""Level packing: choose the group multiset and place the long sequences for a target makespan C.

For a level C every long ("big") sequence s needs a degree d with t_d(s) <= C. Taking them by
descending length, each goes to the smallest such degree (least GPU-seconds: a larger degree only
adds all-to-all), into an open group of that degree where it still finishes by C (best fit), or
else into a new group of that degree while devices remain. Devices left over become groups of
the smallest degree. The short sequences are treated as fluid: C is feasible when their work
fits the slack below C of all groups (each degree at its own speed) and their tokens fit the
free memory. `level_pack_search` bisects C between a lower bound and a known makespan and
returns the multiset of the smallest feasible level with the long sequences placed; assign.py's
water-filling then places the short ones and refine.py polishes the result.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from megatron_ext.planner.flexsp.assign import Assignment, MicroBatchProblem, water_fill

GROWTH = 1.08
GROWTH_STEPS = 36
"""The upper level grows by 1.08x at most 36 times (to ~16x the lower bound); plans land a few
percent above the bound, so small steps leave less to bisect."""

Packed = tuple[list[int], list[float], list[int], list[int], int]
"""What `_pack` opens for a level: each group's degree index, load and tokens, each long
sequence's group, and how many degree-0 groups the short sequences get."""


def _spill(key_loads: list[list[float]], key_ids: list[list[int]], tokens: list[int],
           row: list[float], length: int, j: int, level: float, cap: int,
           degrees: list[int]) -> int | None:
    """An open group of a larger degree than j whose slack below the level holds the sequence
    (best fit: the least slack left), or None."""
    best, best_left = None, float("inf")
    for j2 in range(j + 1, len(degrees)):
        kl, ki = key_loads[j2], key_ids[j2]
        room = cap * degrees[j2] - length
        t = row[j2]
        for load, g in zip(kl, ki):
            left = level - load - t
            if left >= 0 and tokens[g] <= room and left < best_left:
                best, best_left = g, left
    return best


def _pack(problem: MicroBatchProblem, num_gpus: int, num_big: int, level: float,
          small_work: np.ndarray, small_tokens: int, spill: bool = False) -> Packed | None:
    """Open groups and big placements for `level`, or None if the level is infeasible."""
    degrees = problem.degrees.tolist()
    num_deg = len(degrees)
    rows, jmin, lengths = problem.rows, problem.min_deg_list, problem.length_list
    cap = problem.capacity_tokens
    lat = problem.latency_s.tolist()
    group_j: list[int] = []
    loads: list[float] = []
    tokens: list[int] = []
    # open groups of each degree sorted by load: parallel lists of loads and group ids
    key_loads: list[list[float]] = [[] for _ in range(num_deg)]
    key_ids: list[list[int]] = [[] for _ in range(num_deg)]
    seq_group = [-1] * num_big
    free = num_gpus
    g: int | None  # the group a sequence joins (_spill may find none)
    bisect_right = bisect.bisect_right
    for k in range(num_big):
        row, length = rows[k], lengths[k]
        for j in range(jmin[k], num_deg):
            t = row[j]
            if t + lat[j] > level:
                continue
            kl, ki, room = key_loads[j], key_ids[j], cap * degrees[j] - length
            # best fit: the fullest open group of this degree still finishing by the level
            idx = bisect_right(kl, level - t) - 1
            while idx >= 0 and tokens[ki[idx]] > room:
                idx -= 1
            if idx >= 0:
                del kl[idx]
                g = ki.pop(idx)
                loads[g] += t
            elif spill and (g := _spill(key_loads, key_ids, tokens, row, length, j, level,
                                          cap, degrees)) is not None:
                j2 = group_j[g]
                idx2 = key_ids[j2].index(g)
                del key_loads[j2][idx2]
                key_ids[j2].pop(idx2)
                loads[g] += row[j2]
                pos = bisect_right(key_loads[j2], loads[g])
                key_loads[j2].insert(pos, loads[g])
                key_ids[j2].insert(pos, g)
                tokens[g] += length
                seq_group[k] = g
                break
            elif free >= degrees[j]:
                g = len(group_j)
                group_j.append(j)
                loads.append(t + lat[j])
                tokens.append(0)
                free -= degrees[j]
            else:
                continue
            pos = bisect_right(kl, loads[g])
            kl.insert(pos, loads[g])
            ki.insert(pos, g)
            tokens[g] += length
            seq_group[k] = g
            break
        else:
            return None
    d0 = degrees[0]
    num_small_groups = free // d0
    # fluid check for the short sequences: slack below the level, in degree-0 time units
    if small_tokens:
        gj = np.asarray(group_j, dtype=np.int64)
        slack = np.maximum(level - np.asarray(loads), 0.0) if gj.size else np.zeros(0)
        # fraction of the short sequences' work that fits; small_work[j]: all of it at degree j
        capacity = float((slack / small_work[gj]).sum()) if gj.size else 0.0
        capacity += num_small_groups * max(level - lat[0], 0.0) / small_work[0]
        room = int((cap * np.asarray(degrees)[gj] - np.asarray(tokens)).sum()) if gj.size else 0
        room += num_small_groups * cap * d0
        if capacity < 1.0 or room < small_tokens:
            return None
    return group_j, loads, tokens, seq_group, num_small_groups


def level_pack_search(
    problem: MicroBatchProblem, num_gpus: int, num_big: int, lo: float,
    iters: int = 6, rel_tol: float = 0.01, spill: bool = False, below: float | None = None,
) -> tuple[Assignment, float] | None:
    """Smallest feasible level above the lower bound `lo`, found by growing an upper bound
    geometrically and bisecting to `rel_tol`; realised as an Assignment, with the level (the
    fluid estimate of the makespan the short sequences can reach). None if no level packs.
    `spill`: a long sequence may take the slack of an open group of a larger degree before a
    new group opens (see _spill). `below`: only levels under it (by rel_tol) are of interest."""
    small_work = problem.times[num_big:].sum(axis=0)  # [num_deg]: all short ones at degree j
    small_tokens = int(problem.lengths[num_big:].sum())

    def pack(level: float) -> Packed | None:
        return _pack(problem, num_gpus, num_big, level, small_work, small_tokens, spill)

    if below is not None:  # one probe: no growth
        hi = below / (1 + rel_tol)
        best = pack(hi) if hi > lo else None
    else:
        hi, best = lo, None
        for step in range(GROWTH_STEPS):
            # the first probe is the tolerance itself: a quarter of the micro-batches pack there
            hi *= (1 + rel_tol) if step == 0 else GROWTH
            best = pack(hi)
            if best is not None:
                break
            if step == 0 and pack(math.inf) is None:
                return None  # memory, not time, is what fails: no level packs
            lo = hi
    if best is None:
        return None
    level = hi
    for _ in range(iters):
        if hi <= lo * (1 + rel_tol):
            break
        mid = 0.5 * (lo + hi)
        packed = pack(mid)
        if packed is None:
            lo = mid
        else:
            hi, best, level = mid, packed, mid
    state = _realise(problem, best, num_big)
    return None if state is None else (state, level)


def _realise(problem: MicroBatchProblem, best: Packed, num_big: int) -> Assignment | None:
    """The packed long sequences as an Assignment (descending degree), short ones water-filled."""
    k = problem.lengths.size
    group_j, loads, tokens, seq_group, num_small_groups = best
    group_j = group_j + [0] * num_small_groups
    loads = loads + [0.0] * num_small_groups
    tokens = tokens + [0] * num_small_groups
    order = sorted(range(len(group_j)), key=lambda g: -group_j[g])  # descending degree: aligned
    rank = {g: i for i, g in enumerate(order)}
    state = Assignment(
        group_deg_idx=np.asarray([group_j[g] for g in order], dtype=np.int64),
        seq_group=np.full(k, -1, dtype=np.int64),
        loads=np.asarray([loads[g] for g in order]),
        tokens=np.asarray([tokens[g] for g in order], dtype=np.int64),
    )
    state.seq_group[:num_big] = [rank[g] for g in seq_group]
    return state if water_fill(problem, state, num_big) else None
