"""Pipeline partition: how many layers each stage gets, balancing memory and time.

Input: slot[k, n] = seconds of one micro-batch slot of stage k holding n layers (from the stage's
layerwise DP at that stage's memory budget; inf where n layers do not fit), and m micro-batches.
Objective (the 1F1B formula of cost/pipeline.py): sum_k slot[k, n_k] + (m - 1) max_k slot[k, n_k],
subject to sum_k n_k = L and n_k >= 1.

`best_partition` is exact. For every candidate bottleneck tau (ascending distinct slot values)
it solves min sum_k slot[k, n_k] with slot[k, n_k] <= tau by a DP over stages, and stops once
(unconstrained min sum) + (m - 1) tau cannot beat the best found: any partition whose bottleneck
is tau costs at least that much. Memory is honoured because infeasible counts are inf.

Models with layers of several kinds (MoE: dense and MoE layers) give slot[k, a, n]: stage k
starting at layer a with n layers; the DP over stages knows each stage's start, so the same
exact method applies (`bmw_partition` then defers to it).

`bmw_partition` is Galvatron-BMW's heuristic (TKDE'24): start from the memory-balanced split
(layers in proportion to what each stage's memory holds) and move layers off the slowest stage
towards faster ones while memory allows, keeping the best objective seen. It is kept as a
reference: tests check that the exact partition is never worse.
"""

from __future__ import annotations

import numpy as np


def _stage_times(slot: np.ndarray, counts: np.ndarray | list[int]) -> np.ndarray:
    if slot.ndim == 2:
        return np.array([slot[k, n] for k, n in enumerate(counts)])
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return np.array([slot[k, a, n] for k, (a, n) in enumerate(zip(starts, counts))])


def partition_objective(
    slot: np.ndarray, counts: np.ndarray | list[int], num_microbatches: int
) -> float:
    times = _stage_times(slot, counts)
    if not np.all(np.isfinite(times)):
        return np.inf
    return float(times.sum() + (num_microbatches - 1) * times.max())


def _min_sum(slot: np.ndarray, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """h[k, j] = min sum over stages < k+1 holding j layers; arg[k, j] = layers of stage k."""
    pp, width = slot.shape[0], slot.shape[-1]
    j = np.arange(num_layers + 1)[:, None]
    n = np.arange(width)[None, :]
    src = j - n  # [L+1, N+1]
    ok = src >= 0
    src = np.where(ok, src, 0)
    h = np.full((pp, num_layers + 1), np.inf)
    arg = np.zeros((pp, num_layers + 1), dtype=np.int64)
    prev = np.full(num_layers + 1, np.inf)
    prev[0] = 0.0
    for k in range(pp):
        here = slot[k][None, :] if slot.ndim == 2 else slot[k][src, n]
        total = np.where(ok, prev[src] + here, np.inf)
        arg[k] = np.argmin(total, axis=1)
        h[k] = total[np.arange(num_layers + 1), arg[k]]
        prev = h[k]
    return h, arg


def _unwind(arg: np.ndarray, num_layers: int) -> list[int]:
    counts = []
    j = num_layers
    for k in range(arg.shape[0] - 1, -1, -1):
        counts.append(int(arg[k, j]))
        j -= counts[-1]
    return counts[::-1]


def best_partition(
    slot: np.ndarray,  # [pp, N+1], slot[k, n]; column 0 is ignored (stages are non-empty)
    num_layers: int,
    num_microbatches: int,
) -> tuple[float, list[int]] | None:
    """Exact minimum of the module's objective; None if no partition fits."""
    slot = np.array(slot, dtype=float)
    slot[..., 0] = np.inf
    pp = slot.shape[0]
    if slot.shape[-1] < 2 or pp > num_layers:
        return None
    h, arg = _min_sum(slot, num_layers)
    floor = h[-1, num_layers]
    if not np.isfinite(floor):
        return None
    best = (
        partition_objective(slot, _unwind(arg, num_layers), num_microbatches),
        _unwind(arg, num_layers),
    )
    if num_microbatches == 1:
        return best
    values = np.unique(slot[np.isfinite(slot)])
    # The bottleneck is at least the smallest stage's cheapest feasible slot of every stage.
    start = np.searchsorted(values, np.max(np.min(slot.reshape(pp, -1), axis=1)))
    for tau in values[start:]:
        if floor + (num_microbatches - 1) * tau >= best[0]:
            break
        capped = np.where(slot <= tau, slot, np.inf)
        h, arg = _min_sum(capped, num_layers)
        if np.isfinite(h[-1, num_layers]):
            counts = _unwind(arg, num_layers)
            obj = partition_objective(slot, counts, num_microbatches)
            if obj < best[0]:
                best = (obj, counts)
    return best


def bmw_partition(
    slot: np.ndarray, num_layers: int, num_microbatches: int
) -> tuple[float, list[int]] | None:
    """Galvatron-BMW's memory-to-time walk (see module docstring); None if nothing fits."""
    if np.ndim(slot) == 3:  # start-dependent slots (layer kinds): the exact partition
        return best_partition(slot, num_layers, num_microbatches)
    slot = np.array(slot, dtype=float)
    slot[:, 0] = np.inf
    pp, width = slot.shape
    capacity = np.array(
        [max([n for n in range(width) if np.isfinite(slot[k, n])], default=0) for k in range(pp)]
    )
    if capacity.sum() < num_layers or np.any(capacity < 1):
        return None
    counts = _memory_balanced(capacity, num_layers)
    best = (partition_objective(slot, counts, num_microbatches), list(counts))
    for _ in range(num_layers * pp):
        times = np.array([slot[k, n] for k, n in enumerate(counts)])
        slow = int(np.argmax(times))
        takers = [
            k
            for k in range(pp)
            if k != slow and counts[k] + 1 < width and np.isfinite(slot[k, counts[k] + 1])
        ]
        if counts[slow] <= 1 or not takers:
            break
        fast = min(takers, key=lambda k: slot[k, counts[k] + 1])
        if slot[fast, counts[fast] + 1] >= times[slow]:
            break  # moving would not lower the bottleneck: time-balanced
        counts[slow] -= 1
        counts[fast] += 1
        obj = partition_objective(slot, counts, num_microbatches)
        if obj < best[0]:
            best = (obj, list(counts))
    return best


def _memory_balanced(capacity: np.ndarray, num_layers: int) -> list[int]:
    """Layers in proportion to each stage's capacity (largest remainder), each within capacity."""
    share = capacity / capacity.sum() * num_layers
    counts = np.maximum(1, np.floor(share).astype(np.int64))
    counts = np.minimum(counts, capacity)
    order = np.argsort(-(share - np.floor(share)))
    while counts.sum() < num_layers:
        for k in order:
            if counts.sum() < num_layers and counts[k] < capacity[k]:
                counts[k] += 1
    while counts.sum() > num_layers:
        k = int(np.argmax(counts))
        counts[k] -= 1
    return [int(c) for c in counts]
