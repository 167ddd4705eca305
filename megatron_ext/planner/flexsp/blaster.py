"""Micro-batch cutting ("Sequence Blaster", FlexSP §4.2 / App. A) for a descending-sorted batch.

Two cuts of a batch into M micro-batches, both returning positions into the sorted order:
- `consecutive_cut`: FlexSP's rule. Cut the descending list into M consecutive runs minimising
  the largest run's tokens (Eq. 23). Exact min-max linear partition by binary search on the
  bound with a greedy check over prefix sums (the greedy is exact for contiguous runs).
- `balanced_cut`: ours. Deal sequences (descending) to the micro-batch with the least
  GPU-seconds so far whose tokens stay under `token_limit`. Spreads the quadratic work of the
  long sequences over micro-batches instead of piling it into the first one (§12.5 weakness).
"""

from __future__ import annotations

import heapq

import numpy as np


def consecutive_cut(lengths: np.ndarray, num_microbatches: int) -> list[np.ndarray]:
    """Positions [0, K) cut into `num_microbatches` consecutive runs (some may be empty)."""
    k = lengths.size
    prefix = np.concatenate([[0], np.cumsum(lengths)])  # [K+1]
    lo, hi = int(lengths.max()), int(prefix[-1])
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_cuts(prefix, mid)) <= num_microbatches:
            hi = mid
        else:
            lo = mid + 1
    cuts = _greedy_cuts(prefix, lo)
    bounds = [0] + cuts
    runs = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(cuts))]
    runs += [np.arange(k, k)] * (num_microbatches - len(runs))
    return runs


def _greedy_cuts(prefix: np.ndarray, bound: int) -> list[int]:
    """End positions of runs filled greedily up to `bound` tokens each."""
    ends, start, k = [], 0, prefix.size - 1
    while start < k:
        end = int(np.searchsorted(prefix, prefix[start] + bound, side="right")) - 1
        end = max(end, start + 1)
        ends.append(end)
        start = end
    return ends


def balanced_cut(
    lengths: np.ndarray,  # [K] descending
    gpu_seconds: np.ndarray,  # [K] each sequence's GPU-seconds at its smallest degree
    num_microbatches: int,
    token_limit: float,
) -> list[np.ndarray] | None:
    """Greedy least-loaded dealing under a token limit; None if a sequence fits nowhere."""
    heap = [(0.0, m) for m in range(num_microbatches)]
    tokens = [0] * num_microbatches
    members: list[list[int]] = [[] for _ in range(num_microbatches)]
    for k, (length, work) in enumerate(zip(lengths.tolist(), gpu_seconds.tolist())):
        skipped = []
        while heap and tokens[heap[0][1]] + length > token_limit:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        load, m = heapq.heappop(heap)
        members[m].append(k)
        tokens[m] += length
        heapq.heappush(heap, (load + work, m))
        for item in skipped:
            heapq.heappush(heap, item)
    return [np.asarray(run, dtype=np.int64) for run in members]
