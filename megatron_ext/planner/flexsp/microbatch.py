"""Plan one micro-batch: candidate group multisets and assignments, then local search.

`microbatch_candidates` builds up to `max_evals + 1` complete assignments without local search:
the multisets with the smallest lower bounds (multisets.py), each filled by earliest-finish-time
+ water-filling (assign.py), and the level-packing search (level_pack.py). Each candidate has a
score (its makespan, or for level packing the fluid level it reached, a closer predictor of the
makespan after local search). `finish` refines the best-scored ones (refine.py) and keeps the
fastest. The planner ranks whole micro-batch cuts by score and only finishes the promising ones.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from megatron_ext.planner.flexsp.assign import Assignment, MicroBatchProblem, assign
from megatron_ext.planner.flexsp.cost import FlexSPCostModel
from megatron_ext.planner.flexsp.level_pack import level_pack_search
from megatron_ext.planner.flexsp.multisets import enumerate_multisets, lower_bounds
from megatron_ext.planner.flexsp.refine import refine

TIGHT_FILL = 0.7
"""Above this share of the cluster's tokens a micro-batch's multisets are not pruned by time:
packing the memory may need group shapes the time-ideal degrees would not suggest."""


@dataclass(frozen=True, slots=True)
class _Coefficients:
    degrees: np.ndarray  # [num_deg]
    attn_coef: np.ndarray  # [num_deg] seconds per token^2
    linear_coef: np.ndarray  # [num_deg] seconds per token (compute + all-to-all)
    latency_s: np.ndarray  # [num_deg]


@functools.lru_cache(maxsize=32)
def _coefficients(cost: FlexSPCostModel) -> _Coefficients:
    degrees = np.asarray(cost.degrees, dtype=np.int64)
    return _Coefficients(
        degrees=degrees,
        attn_coef=cost.attn_s_per_token_sq / degrees,
        linear_coef=np.array([cost.linear_s_per_token / d + cost.a2a_s_per_token(d)
                              for d in cost.degrees]),
        latency_s=np.array([cost.a2a_latency_s(d) for d in cost.degrees]),
    )


def make_problem(lengths_desc: np.ndarray, cost: FlexSPCostModel) -> MicroBatchProblem:
    """Per-degree times of sequences sorted by descending length (each must fit some degree)."""
    coef = _coefficients(cost)
    s = lengths_desc.astype(np.float64)
    times = (s * s)[:, None] * coef.attn_coef[None, :] + s[:, None] * coef.linear_coef[None, :]
    cap = cost.capacity_tokens
    min_idx = np.searchsorted(cap * coef.degrees, lengths_desc, side="left")
    assert min_idx.max(initial=0) < coef.degrees.size, "caller checks the longest sequence"
    return MicroBatchProblem(lengths=lengths_desc, times=times, min_deg_idx=min_idx,
                             degrees=coef.degrees, latency_s=coef.latency_s, capacity_tokens=cap)


@dataclass(slots=True)
class Candidates:
    """Unrefined assignments of one micro-batch, each with its score (lower is better)."""

    problem: MicroBatchProblem
    found: list[tuple[float, Assignment]] = field(default_factory=list)

    @property
    def score(self) -> float:
        return min((s for s, _ in self.found), default=math.inf)


def microbatch_candidates(
    problem: MicroBatchProblem, num_gpus: int, *, max_evals: int, big_fraction: float,
    level_pack: bool, fixed_counts: np.ndarray | None = None,
) -> Candidates:
    """Assignments of this micro-batch to try (empty `found` if no multiset holds it)."""
    k = problem.lengths.size
    min_time = problem.times[np.arange(k), problem.min_deg_idx]  # [K]
    avg_load = float((min_time * problem.degrees[problem.min_deg_idx]).sum()) / num_gpus
    big = (problem.min_deg_idx > 0) | (min_time > big_fraction * avg_load)
    num_big = int(np.argmin(big)) if not big.all() else k  # big is a prefix (monotone in length)
    if fixed_counts is not None:
        counts = fixed_counts[None, :]
    else:
        degrees = tuple(problem.degrees.tolist())
        tight = problem.lengths.sum() > TIGHT_FILL * num_gpus * problem.capacity_tokens
        caps = None if tight else _count_caps(problem, avg_load)
        counts = enumerate_multisets(num_gpus, degrees, caps)
        if caps is not None:  # the homogeneous multisets are always candidates
            counts = np.vstack([counts, _homogeneous(num_gpus, degrees)])
    bound = lower_bounds(counts, problem.degrees, problem.times, problem.min_deg_idx,
                         problem.lengths, problem.capacity_tokens)
    out = Candidates(problem=problem)
    best = math.inf
    for idx in np.argsort(bound, kind="stable")[:max_evals].tolist():
        if not bound[idx] < best * (1 - 1e-9):
            break
        result = assign(problem, counts[idx], num_big)
        if result is not None:
            out.found.append((result.makespan_s, result))
            best = min(best, result.makespan_s)
    # plus the first homogeneous multiset (in bound order) that packs: equal groups spread memory
    # evenly, a safe fallback when memory is tight and the time-driven candidates fail
    homogeneous = np.flatnonzero(((counts > 0).sum(axis=1) == 1) & np.isfinite(bound))
    for idx in homogeneous[np.argsort(bound[homogeneous], kind="stable")].tolist():
        if not bound[idx] < best * (1 - 1e-9):
            break
        result = assign(problem, counts[idx], num_big)
        if result is not None:
            out.found.append((result.makespan_s, result))
            best = min(best, result.makespan_s)
            break
    if fixed_counts is None and level_pack:
        lo = float(bound.min())
        packed = level_pack_search(problem, num_gpus, num_big, lo,
                                   best if math.isfinite(best) else lo * 8)
        if packed is not None:
            out.found.append((packed[1], packed[0]))
    out.found.sort(key=lambda item: item[0])
    return out


def finish(candidates: Candidates, *, refine_top: int, refine_rounds: int) -> Assignment:
    """Refine the `refine_top` best-scored candidates; return the fastest assignment."""
    assert candidates.found, "finish() needs at least one candidate"
    for _, result in candidates.found[:refine_top]:
        refine(candidates.problem, result, max_rounds=refine_rounds)
    return min((a for _, a in candidates.found), key=lambda a: a.makespan_s)


def _count_caps(problem: MicroBatchProblem, avg_load: float) -> tuple[int, ...]:
    """Most groups of each degree worth trying: sequences whose ideal degree (the smallest one
    at which they finish within the average device load) is at least half that degree."""
    fast_enough = problem.times <= avg_load  # [K, num_deg]
    fast_enough[:, -1] = True
    allowed = np.arange(problem.degrees.size)[None, :] >= problem.min_deg_idx[:, None]
    ideal = np.argmax(fast_enough & allowed, axis=1)  # [K]
    return tuple(int((ideal >= j - 1).sum()) for j in range(problem.degrees.size))


def _homogeneous(num_gpus: int, degrees: tuple[int, ...]) -> np.ndarray:
    """[num_deg', num_deg] count vectors of N/d groups of degree d, for each d dividing N."""
    rows = [np.eye(len(degrees), dtype=np.int64)[j] * (num_gpus // d)
            for j, d in enumerate(degrees) if num_gpus % d == 0]
    return np.asarray(rows, dtype=np.int64)
