"""Exact FlexSP micro-batch MILP (FlexSP §4.1.1, Eqs. 6-10) solved with scipy's HiGHS.

An oracle for small instances: it measures how far the fast planner is from optimal. Same cost
model as the fast planner (cost.py), exact lengths (no bucketing), one micro-batch.

Virtual groups p = (degree d_j, copy c), c < min(N / d_j, K). Variables: x[k, p] binary (sequence
k in group p, only where d_j holds it), m[p] binary (group used), C >= 0 (slowest group).
    min C   s.t.  sum_p x[k, p] = 1                                   (each sequence once, Eq. 10)
                  sum_k t_j(s_k) x[k, p] + lat_j m[p] - C <= 0        (time, Eqs. 6/12-14)
                  sum_k s_k x[k, p] - capacity * d_j m[p] <= 0        (memory and x <= m, Eqs. 7/9)
                  sum_p d_j m[p] <= N                                 (devices, Eq. 8)
Symmetry breaking between copies of one degree: m[j, c] >= m[j, c+1] and the copies' loads are
non-increasing (interchangeable copies can always be sorted so). Both hold together: an unused
copy has load 0 and sorts last. The micro-batch time is fixed_s_per_microbatch + C.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from megatron_ext.errors import PlanError
from megatron_ext.planner.flexsp.assign import MicroBatchProblem
from megatron_ext.planner.flexsp.cost import FlexSPCostModel
from megatron_ext.planner.flexsp.microbatch import make_problem


@dataclass(frozen=True, kw_only=True, slots=True)
class MilpResult:
    """Outcome of one MILP solve."""

    time_s: float | None
    """Micro-batch time of the best solution found (fixed term + slowest group); None if none."""
    optimal: bool
    """HiGHS proved optimality (to its default relative gap of 1e-4)."""
    bound_s: float
    """Proven lower bound on the micro-batch time."""
    groups: tuple[tuple[int, tuple[int, ...]], ...]
    """(degree, sequence ids) of every used group of the best solution."""
    solve_s: float
    """Wall-clock seconds HiGHS took."""


def solve_microbatch_milp(
    lengths: list[int] | np.ndarray, cost: FlexSPCostModel, *, time_limit_s: float = 10.0
) -> MilpResult:
    """Optimal single-micro-batch plan of `lengths` (all sequences run concurrently)."""
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    if lengths_arr.ndim != 1 or lengths_arr.size == 0 or lengths_arr.min() < 1:
        raise PlanError("lengths must be a non-empty list of positive token counts")
    order = np.argsort(-lengths_arr, kind="stable")
    cost.min_degree_for(int(lengths_arr[order[0]]))
    problem = make_problem(lengths_arr[order], cost)
    degrees = problem.degrees.tolist()
    groups, pairs, builder = _build(problem, cost)
    c_col = len(pairs) + len(groups)  # columns: x pairs, then m[p], then C
    objective = np.zeros(c_col + 1)
    objective[c_col] = 1.0
    integrality = np.ones(c_col + 1)
    integrality[c_col] = 0
    upper = np.ones(c_col + 1)
    upper[c_col] = np.inf
    start = time.perf_counter()
    res = milp(objective, constraints=builder.constraint(), integrality=integrality,
               bounds=Bounds(np.zeros(c_col + 1), upper),
               options={"time_limit": time_limit_s, "disp": False})
    solve_s = time.perf_counter() - start
    beta = cost.fixed_s_per_microbatch
    bound = beta + float(getattr(res, "mip_dual_bound", 0.0) or 0.0)
    if res.x is None:
        return MilpResult(time_s=None, optimal=False, bound_s=bound, groups=(), solve_s=solve_s)
    chosen: dict[int, list[int]] = {}
    for col, (kk, p) in enumerate(pairs):
        if res.x[col] > 0.5:
            chosen.setdefault(p, []).append(int(order[kk]))
    used = tuple((degrees[groups[p][0]], tuple(ids)) for p, ids in sorted(chosen.items()))
    optimal = res.status == 0
    return MilpResult(time_s=beta + float(res.x[c_col]), optimal=optimal,
                      bound_s=beta + float(res.x[c_col]) if optimal else bound,
                      groups=used, solve_s=solve_s)


def _build(problem: MicroBatchProblem, cost: FlexSPCostModel
           ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], _Rows]:
    """Virtual groups (degree index, copy), x columns (sequence, group) and all rows."""
    k, degrees = problem.lengths.size, problem.degrees.tolist()
    groups = [(j, c) for j, d in enumerate(degrees) for c in range(min(cost.num_gpus // d, k))]
    num_p = len(groups)
    pairs = [(kk, p) for kk in range(k) for p, (j, _) in enumerate(groups)
             if j >= problem.min_deg_idx[kk]]
    m_col, c_col = len(pairs), len(pairs) + num_p
    builder = _Rows(num_cols=c_col + 1)
    x_of_seq: list[list[int]] = [[] for _ in range(k)]
    x_of_group: list[list[int]] = [[] for _ in range(num_p)]
    for col, (kk, p) in enumerate(pairs):
        x_of_seq[kk].append(col)
        x_of_group[p].append(col)
    for kk in range(k):  # each sequence once
        builder.add(x_of_seq[kk], [1.0] * len(x_of_seq[kk]), 1.0, 1.0)
    load = [[(col, float(problem.times[pairs[col][0], groups[p][0]])) for col in x_of_group[p]]
            for p in range(num_p)]
    for p, (j, _) in enumerate(groups):  # time <= C, memory <= capacity * m
        cols = [col for col, _ in load[p]]
        builder.add(cols + [m_col + p, c_col], [t for _, t in load[p]]
                    + [float(problem.latency_s[j]), -1.0], -np.inf, 0.0)
        builder.add(cols + [m_col + p], [float(problem.lengths[pairs[col][0]]) for col in cols]
                    + [-float(cost.capacity_tokens * degrees[j])], -np.inf, 0.0)
    builder.add([m_col + p for p in range(num_p)], [float(degrees[j]) for j, _ in groups],
                -np.inf, float(cost.num_gpus))
    for p in range(num_p - 1):
        if groups[p][0] == groups[p + 1][0]:  # consecutive copies of one degree: symmetry
            builder.add([m_col + p, m_col + p + 1], [1.0, -1.0], 0.0, np.inf)
            cols = [col for col, _ in load[p]] + [col for col, _ in load[p + 1]]
            vals = [t for _, t in load[p]] + [-t for _, t in load[p + 1]]
            builder.add(cols, vals, 0.0, np.inf)
    return groups, pairs, builder


class _Rows:
    """Accumulates sparse constraint rows lo <= a . x <= hi."""

    def __init__(self, num_cols: int) -> None:
        self.num_cols = num_cols
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, cols: list[int], vals: list[float], lo: float, hi: float) -> None:
        row = len(self.lo)
        self.rows += [row] * len(cols)
        self.cols += cols
        self.vals += vals
        self.lo.append(lo)
        self.hi.append(hi)

    def constraint(self) -> LinearConstraint:
        a = coo_matrix((self.vals, (self.rows, self.cols)),
                       shape=(len(self.lo), self.num_cols)).tocsr()
        return LinearConstraint(a, np.asarray(self.lo), np.asarray(self.hi))
