"""Plan one micro-batch: candidate group multisets and assignments, then local search.

`microbatch_candidates` gives the first candidate(s) without local search: the level-packing
search (level_pack.py), whose score is the fluid level it reached (a close predictor of the
makespan after local search); only if that finds nothing, the multisets with the smallest lower
bounds (multisets.py, each filled by earliest-finish-time + water-filling, assign.py) and then
the homogeneous ones. The planner scores whole micro-batch cuts with these. `finish` then, for
the cuts worth it, assigns more multisets in bound order and the best homogeneous ones, refines
the best candidates (refine.py) and keeps the fastest.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from megatron_ext.planner.flexsp.assign import Assignment, MicroBatchProblem, assign
from megatron_ext.planner.flexsp.cost import FlexSPCostModel
from megatron_ext.planner.flexsp.level_pack import level_pack_search
from megatron_ext.planner.flexsp.multisets import (
    enumerate_multisets,
    fit_caps,
    lower_bounds,
)
from megatron_ext.planner.flexsp.refine import refine

MAX_MULTISETS = 4096
"""At most this many multisets per micro-batch (large N): caps shrink until they fit."""
PAIR_SLACK = 4
"""Groups of a degree beyond those its ideal sequences need (see _count_caps)."""
HOMOGENEOUS_TRIES = 3
"""Homogeneous multisets (best bounds first, while below the best found) every finished
micro-batch also tries: the static special case is then never missed."""


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
    """Unrefined assignments of one micro-batch, each with its score (lower is better), and
    the group multisets (enumerated on first use, in lower-bound order) still to be tried."""

    problem: MicroBatchProblem
    num_gpus: int
    num_big: int
    """Sequences placed one by one (the rest are water-filled)."""
    avg_load: float
    """Least possible GPU-seconds of the micro-batch over the device count."""
    fixed_counts: np.ndarray | None = None
    """The only multiset allowed (static baseline), or None."""
    found: list[tuple[float, Assignment]] = field(default_factory=list)
    level_s: float | None = None
    """Level the plain level-packing search reached (None if it found nothing or did not run)."""
    counts: np.ndarray | None = None
    """[num_multisets, num_deg] candidate multisets, once enumerated."""
    bound: np.ndarray | None = None
    """[num_multisets] their lower bounds."""
    untried: list[int] = field(default_factory=list)
    """Multiset rows not assigned yet, ascending bound."""

    @property
    def score(self) -> float:
        return min((s for s, _ in self.found), default=math.inf)

    @property
    def lower_bound_s(self) -> float:
        """No assignment of this micro-batch is faster: its least GPU-seconds over the devices,
        or its longest sequence's fastest time (without the fixed term)."""
        problem = self.problem
        fastest = problem.times[0, problem.min_deg_idx[0]:].min()
        return max(self.avg_load, float(fastest))

    def _enumerate(self) -> None:
        if self.counts is not None:
            return
        problem = self.problem
        if self.fixed_counts is not None:
            counts = self.fixed_counts[None, :]
        else:
            degrees = tuple(problem.degrees.tolist())
            caps = fit_caps(self.num_gpus, degrees, _count_caps(problem, self.avg_load),
                            MAX_MULTISETS)
            counts = enumerate_multisets(self.num_gpus, degrees, caps)
            # the homogeneous multisets are always candidates (memory-tight fallback)
            missing = [row for row in _homogeneous(self.num_gpus, degrees)
                       if any(row[j] > caps[j] for j in range(1, len(degrees)))]
            if missing:
                counts = np.vstack([counts, np.asarray(missing)])
        bound = lower_bounds(counts, problem.degrees, problem.times, problem.min_deg_idx,
                             problem.lengths, problem.capacity_tokens)
        order = np.argsort(bound, kind="stable")
        self.counts, self.bound = counts, bound
        self.untried = order[np.isfinite(bound[order])].tolist()

    def try_multisets(self, num: int) -> None:
        """Assign up to `num` more multisets, stopping when the bound reaches the best found."""
        if num <= 0:
            return
        self._enumerate()
        assert self.counts is not None and self.bound is not None
        while num > 0 and self.untried:
            idx = self.untried[0]
            if not self.bound[idx] < self.score * (1 - 1e-9):
                return
            self.untried.pop(0)
            num -= 1
            self._add(assign(self.problem, self.counts[idx], self.num_big))

    def try_homogeneous(self, num: int, *, until_found: bool = False) -> None:
        """Up to `num` homogeneous multisets (in bound order): equal groups spread memory evenly,
        which wins when memory is tight and a fallback when time-driven candidates fail.
        With `until_found`, stop at the first one that packs."""
        self._enumerate()
        assert self.counts is not None and self.bound is not None
        homogeneous = (self.counts > 0).sum(axis=1) == 1  # [num_multisets]
        for idx in [i for i in self.untried if homogeneous[i]][:num]:
            if not self.bound[idx] < self.score * (1 - 1e-9):
                return
            self.untried.remove(idx)
            if self._add(assign(self.problem, self.counts[idx], self.num_big)) and until_found:
                return

    def _add(self, result: Assignment | None) -> bool:
        if result is not None:
            self.found.append((result.makespan_s, result))
        return result is not None


def microbatch_candidates(
    problem: MicroBatchProblem, num_gpus: int, *, max_evals: int, big_fraction: float,
    level_pack: bool, fixed_counts: np.ndarray | None = None,
) -> Candidates:
    """First candidates of this micro-batch (empty `found` if none holds it): the level-packing
    search, plus `max_evals` multisets by lower bound, or more when nothing fits yet."""
    k = problem.lengths.size
    min_time = problem.times[np.arange(k), problem.min_deg_idx]  # [K]
    avg_load = float((min_time * problem.degrees[problem.min_deg_idx]).sum()) / num_gpus
    big = (problem.min_deg_idx > 0) | (min_time > big_fraction * avg_load)
    num_big = int(np.argmin(big)) if not big.all() else k  # big is a prefix (monotone in length)
    out = Candidates(problem=problem, num_gpus=num_gpus, num_big=num_big, avg_load=avg_load,
                     fixed_counts=fixed_counts)
    if fixed_counts is None and level_pack:
        fastest = np.where(np.arange(problem.degrees.size) >= problem.min_deg_idx[0],
                           problem.times[0], np.inf).min()
        packed = level_pack_search(problem, num_gpus, num_big, max(avg_load, float(fastest)))
        if packed is not None:
            out.found.append((packed[1], packed[0]))
            out.level_s = packed[1]
    out.try_multisets(max_evals if out.found else max(max_evals, 1))
    if not out.found:
        out.try_homogeneous(len(problem.degrees), until_found=True)
    out.found.sort(key=lambda item: item[0])
    return out


def finish(candidates: Candidates, *, extra_evals: int, refine_top: int,
           refine_rounds: int, spill: bool = True) -> Assignment:
    """Try the spilling level search (`spill`) and `extra_evals` more multisets, refine the
    `refine_top` best-scored candidates, and return the fastest assignment."""
    assert candidates.found, "finish() needs at least one candidate"
    extra: list[Assignment] = []
    if spill and candidates.level_s is not None:
        # long sequences may also fill the slack of larger groups (the group a very long
        # sequence forces onto many devices): a level below the plain search's, if it packs
        problem = candidates.problem
        fastest = problem.times[0, problem.min_deg_idx[0]:].min()
        packed = level_pack_search(problem, candidates.num_gpus, candidates.num_big,
                                   max(candidates.avg_load, float(fastest)), spill=True,
                                   below=candidates.level_s)
        if packed is not None:
            # refined besides the top ones: it must not push a candidate out of them
            refine(problem, packed[0], max_rounds=refine_rounds)
            extra.append(packed[0])
    candidates.try_multisets(extra_evals)
    candidates.try_homogeneous(HOMOGENEOUS_TRIES)
    candidates.found.sort(key=lambda item: item[0])
    for _, result in candidates.found[:refine_top]:
        refine(candidates.problem, result, max_rounds=refine_rounds)
    candidates.found += [(a.makespan_s, a) for a in extra]
    return min((a for _, a in candidates.found), key=lambda a: a.makespan_s)


def _count_caps(problem: MicroBatchProblem, avg_load: float) -> tuple[int, ...]:
    """Most groups of each degree worth trying. A sequence's ideal degree is the smallest one
    at which it finishes within the average device load; a group of degree d serves the
    sequences whose ideal degree is >= d, plus pairs of those one step below (at most
    PAIR_SLACK such groups: pairing short sequences only adds all-to-all)."""
    fast_enough = problem.times <= avg_load  # [K, num_deg]
    fast_enough[:, -1] = True
    allowed = np.arange(problem.degrees.size)[None, :] >= problem.min_deg_idx[:, None]
    ideal = np.argmax(fast_enough & allowed, axis=1)  # [K]
    per_degree = np.bincount(ideal, minlength=problem.degrees.size)  # [num_deg]
    at_least = np.cumsum(per_degree[::-1])[::-1]  # [num_deg]: sequences with ideal >= j
    caps = [int(at_least[0])]
    for j in range(1, problem.degrees.size):
        caps.append(int(at_least[j]) + min(-(-int(per_degree[j - 1]) // 2), PAIR_SLACK))
    return tuple(caps)


def _homogeneous(num_gpus: int, degrees: tuple[int, ...]) -> np.ndarray:
    """[num_deg', num_deg] count vectors of N/d groups of degree d, for each d dividing N."""
    rows = [np.eye(len(degrees), dtype=np.int64)[j] * (num_gpus // d)
            for j, d in enumerate(degrees) if num_gpus % d == 0]
    return np.asarray(rows, dtype=np.int64)
