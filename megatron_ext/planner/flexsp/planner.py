"""The fast FlexSP planner: micro-batch cutting x group multisets x assignment, in milliseconds.

plan_step(lengths, cost) -> StepPlan:
1. sort the batch by descending length; M_min = ceil(tokens / (N * capacity)); micro-batch
   counts from the first feasible one (plus `extra_microbatches`);
2. per count, the consecutive cut (FlexSP's Sequence Blaster) and the balanced cut
   (blaster.py), each scored by its micro-batches' level-packing searches (microbatch.py);
   cuts whose lower bound or partial score reach the best score are skipped;
3. finish cuts in score order while a score beats the best finished time: per micro-batch,
   power-of-two group multisets in lower-bound order (earliest-finish-time + water-filling),
   the best homogeneous multisets, then local search on the best candidate.
Each micro-batch takes beta_1 + its slowest group (cost.py); the step is their sum.
Deterministic: no randomness and no time limits, so every rank can plan the same batch itself.
`fixed_degree` runs the same machinery with one degree (the static-Ulysses baseline).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from megatron_ext.errors import PlanError
from megatron_ext.planner.flexsp.assign import Assignment, MicroBatchProblem
from megatron_ext.planner.flexsp.blaster import balanced_cut, consecutive_cut
from megatron_ext.planner.flexsp.cost import FlexSPCostModel
from megatron_ext.planner.flexsp.microbatch import (
    Candidates,
    finish,
    make_problem,
    microbatch_candidates,
)
from megatron_ext.planner.flexsp.step_plan import MicroBatchPlan, SPGroup, StepPlan

MAX_EVALS = 16
"""Cap on multisets assigned per micro-batch (per-call overhead dominates tiny micro-batches)."""
MAX_REFINED = 4
"""Cap on refined candidates per micro-batch."""
SCORE_SLACK = 0.05
"""A cut is scored unless its lower bound exceeds the best score by this much (scores are
estimates; local search lands a few percent off them either way)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerOptions:
    """Search effort knobs of the fast planner."""

    extra_microbatches: int = 1
    """Micro-batch counts tried beyond the first feasible one (FlexSP tries 4-5); one more
    helps when the first feasible count packs memory tightly."""
    extra_fill: float = 0.8
    """...but only when every cut of the first feasible count has a micro-batch holding more
    than this fraction of the cluster's tokens: with room to spare, another micro-batch only
    adds its fixed term (no batch of the benchmark gained from one below 0.83)."""
    max_microbatches: int = 64
    """Give up (PlanError) when no count up to this one is feasible."""
    cuts: tuple[str, ...] = ("consecutive", "balanced")
    """Micro-batch cutting rules tried (blaster.py)."""
    max_evals: int = 0
    """Group multisets assigned (in lower-bound order) while scoring cuts; at least one when
    level packing finds nothing. Finishing the chosen cut assigns more (eval_budget)."""
    eval_budget: int = 128
    """Multisets assigned when finishing the chosen cut: eval_budget / num_sequences more
    (small micro-batches are cheap to assign and benefit most)."""
    level_pack: bool = True
    """Also run the level-packing search (level_pack.py) per micro-batch."""
    spill_pack: bool = True
    """Finishing a micro-batch also runs the level search where a long sequence may take the
    slack of an open larger group (the one a very long sequence forces) before opening its own,
    below the plain search's level (wikipedia 384K / 64 GPUs: -0.35% step time)."""
    refine_top: int = 1
    """How many of the best-scored candidates of a micro-batch get local search (at least)."""
    refine_budget: int = 64
    """More refined candidates for small micro-batches: up to refine_budget / num_sequences."""
    refine_rounds: int = 200
    """Local-search rounds per refined assignment."""
    finish_every_count: bool = True
    """Finish the best-scored cut of every micro-batch count (else only the best overall)."""
    finish_slack: float = 0.0
    """A further cut is finished (local search) while its score is below (1 + slack) x the
    best finished plan's time (scores are unrefined estimates)."""
    big_fraction: float = 0.25
    """Sequences slower than this fraction of the average device load are placed one by one."""
    balanced_max_degree: int = 2
    """The balanced cut is tried only when the longest sequence fits this many devices."""
    token_fill: float = 0.95
    """balanced cut: a micro-batch holds at most this fraction of the cluster's tokens."""

    def __post_init__(self) -> None:
        bad = set(self.cuts) - {"consecutive", "balanced"}
        if bad or not self.cuts:
            raise PlanError(f"cuts={self.cuts} must be a non-empty subset of consecutive, balanced")
        if self.max_evals < 0 or self.refine_top < 1 or self.finish_slack < 0:
            raise PlanError(f"max_evals={self.max_evals} and finish_slack={self.finish_slack} "
                            f"must be >= 0, refine_top={self.refine_top} >= 1")
        if self.extra_microbatches < 0:
            raise PlanError(f"extra_microbatches={self.extra_microbatches} must be >= 0")


def plan_step(
    lengths: list[int] | np.ndarray, cost: FlexSPCostModel, options: PlannerOptions | None = None,
    *, fixed_degree: int | None = None,
) -> StepPlan:
    """Plan one global batch. `fixed_degree` forces N/d groups of degree d (static baseline)."""
    options = options or PlannerOptions()
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    if lengths_arr.ndim != 1 or lengths_arr.size == 0 or lengths_arr.min() < 1:
        raise PlanError("lengths must be a non-empty list of positive token counts")
    order = np.argsort(-lengths_arr, kind="stable")
    desc = lengths_arr[order]
    cost.min_degree_for(int(desc[0]))  # PlanError if the longest sequence fits no group
    fixed = _fixed_counts(cost, fixed_degree, int(desc[0]))
    best = _search_cuts(desc, cost, options, fixed)
    if best is None:
        raise PlanError(
            f"no plan fits {desc.size} sequences ({desc.sum()} tokens) on {cost.num_gpus} GPUs "
            f"of {cost.capacity_tokens} tokens in up to {options.max_microbatches} "
            "micro-batches; raise max_microbatches or the memory budget"
        )
    return _to_step_plan(lengths_arr, order, best, cost)


_Planned = tuple[float, list[tuple[np.ndarray, Assignment]]]


def _search_cuts(desc: np.ndarray, cost: FlexSPCostModel, options: PlannerOptions,
                 fixed: np.ndarray | None) -> _Planned | None:
    """Score every micro-batch cut worth trying, then finish them; keep the fastest. The
    best-scored cut of every micro-batch count is finished (scores are unrefined estimates and
    compare poorly across counts); other cuts only while their score beats the best time."""
    scored = sorted(_score_cuts(desc, cost, options, fixed), key=lambda item: item[0])
    leaders = {min(i for i, c in enumerate(scored) if len(c[1]) == n)  # sorted: first is best
               for n in {len(c[1]) for c in scored}} if options.finish_every_count else {0}
    best: _Planned | None = None
    beta = cost.fixed_s_per_microbatch
    for i, (score, runs, cands) in enumerate(scored):
        if best is not None and i not in leaders and score >= best[0] * (1 + options.finish_slack):
            continue
        # finished micro-batches so far + lower bounds of the rest: stop once it cannot win
        total, done, rest = 0.0, [], sum(beta + c.lower_bound_s for c in cands)
        for run, c in zip(runs, cands):
            rest -= beta + c.lower_bound_s
            if best is not None and total + beta + c.lower_bound_s + rest >= best[0]:
                break
            result = finish(c, extra_evals=min(MAX_EVALS, max(1, options.eval_budget // run.size)),
                            refine_top=min(MAX_REFINED, max(options.refine_top,
                                                            options.refine_budget // run.size)),
                            refine_rounds=options.refine_rounds, spill=options.spill_pack)
            total += beta + result.makespan_s
            done.append((run, result))
        if len(done) == len(runs) and (best is None or total < best[0]):
            best = (total, done)
    return best


def _score_cuts(desc: np.ndarray, cost: FlexSPCostModel, options: PlannerOptions,
                fixed: np.ndarray | None) -> list[tuple[float, list[np.ndarray], list[Candidates]]]:
    """(score, runs, candidates) of each cut: its micro-batches' first candidates, unrefined.

    A cut is skipped when its lower bound (each micro-batch: fixed term + its least GPU-seconds
    over N, or its longest sequence's fastest time) or its partial score exceeds the best score
    by SCORE_SLACK.
    """
    whole = make_problem(desc, cost)
    rows = np.arange(desc.size)
    min_gpu_s = whole.times[rows, whole.min_deg_idx] * whole.degrees[whole.min_deg_idx]  # [K]
    fastest = np.where(np.arange(whole.degrees.size)[None, :] >= whole.min_deg_idx[:, None],
                       whole.times, np.inf).min(axis=1)  # [K]
    beta = cost.fixed_s_per_microbatch
    m_min = max(1, math.ceil(desc.sum() / (cost.num_gpus * cost.capacity_tokens)))
    out: list[tuple[float, list[np.ndarray], list[Candidates]]] = []
    best = math.inf
    first_feasible: int | None = None
    room = cost.num_gpus * cost.capacity_tokens
    least_fill = math.inf  # of the cuts of the first feasible count: their fullest micro-batch
    for num_mb in range(m_min, options.max_microbatches + 1):
        if first_feasible is not None and (num_mb > first_feasible + options.extra_microbatches
                                           or least_fill < options.extra_fill):
            break
        count_fill = math.inf
        for runs in _cuts(desc, whole, cost, num_mb, options):
            runs = [r for r in runs if r.size]
            count_fill = min(count_fill, max(int(desc[r].sum()) for r in runs) / room)
            bound = sum(beta + max(min_gpu_s[r].sum() / cost.num_gpus, fastest[r].max())
                        for r in runs)
            limit = best * (1 + SCORE_SLACK)
            if bound >= limit:
                continue
            score, cands = 0.0, []
            for run in runs:
                c = microbatch_candidates(
                    make_problem(desc[run], cost), cost.num_gpus, max_evals=options.max_evals,
                    big_fraction=options.big_fraction, level_pack=options.level_pack,
                    fixed_counts=fixed)
                score += beta + c.score
                if score >= limit:
                    break
                cands.append(c)
            if score < limit:
                best = min(best, score)
                out.append((score, runs, cands))
        if out and first_feasible is None:
            first_feasible, least_fill = num_mb, count_fill
    return out


def step_lower_bound(lengths: list[int] | np.ndarray, cost: FlexSPCostModel) -> float:
    """A lower bound on any plan's step time: M_min fixed terms plus the batch's least
    GPU-seconds over N (every sequence at its smallest feasible degree: no all-to-all a
    larger degree would add), or one fixed term plus the longest sequence's fastest time."""
    desc = np.sort(np.asarray(lengths, dtype=np.int64))[::-1]
    cost.min_degree_for(int(desc[0]))
    problem = make_problem(desc, cost)
    rows = np.arange(desc.size)
    work = float((problem.times[rows, problem.min_deg_idx]
                  * problem.degrees[problem.min_deg_idx]).sum())
    fastest = float(problem.times[0, problem.min_deg_idx[0]:].min())
    m_min = max(1, math.ceil(desc.sum() / (cost.num_gpus * cost.capacity_tokens)))
    beta = cost.fixed_s_per_microbatch
    return max(m_min * beta + work / cost.num_gpus, beta + fastest)


def _fixed_counts(cost: FlexSPCostModel, degree: int | None, longest: int) -> np.ndarray | None:
    if degree is None:
        return None
    if degree not in cost.degrees or cost.num_gpus % degree:
        raise PlanError(f"fixed degree {degree} must be one of {cost.degrees} dividing "
                        f"{cost.num_gpus} GPUs")
    if cost.min_degree_for(longest) > degree:
        raise PlanError(f"fixed degree {degree} cannot hold a {longest}-token sequence; "
                        f"use >= {cost.min_degree_for(longest)}")
    counts = np.zeros(len(cost.degrees), dtype=np.int64)
    counts[cost.degrees.index(degree)] = cost.num_gpus // degree
    return counts


def _cuts(desc: np.ndarray, problem: MicroBatchProblem, cost: FlexSPCostModel, num_mb: int,
          options: PlannerOptions) -> Iterator[list[np.ndarray]]:
    if "consecutive" in options.cuts:
        yield consecutive_cut(desc, num_mb)
    # the balanced cut only pays off while every sequence fits in a few devices; once some need
    # large groups, spreading them over micro-batches fragments memory (benchmark: -5..15%)
    few = problem.degrees[problem.min_deg_idx[0]] <= options.balanced_max_degree
    if "balanced" in options.cuts and num_mb > 1 and few:
        idx = problem.min_deg_idx
        gpu_s = problem.times[np.arange(desc.size), idx] * problem.degrees[idx]
        limit = options.token_fill * cost.num_gpus * cost.capacity_tokens
        runs = balanced_cut(desc, gpu_s, num_mb, max(limit, float(desc[0])))
        if runs is not None:
            yield runs


def _to_step_plan(lengths: np.ndarray, order: np.ndarray,
                  best: tuple[float, list[tuple[np.ndarray, Assignment]]],
                  cost: FlexSPCostModel) -> StepPlan:
    _, planned = best
    degrees = cost.degrees
    length_list = lengths.tolist()
    microbatches = []
    for run, result in planned:
        seq_ids = order[run]  # original index of each position of this micro-batch
        by_group = np.argsort(result.seq_group, kind="stable")  # positions, grouped, ascending
        ends = np.searchsorted(result.seq_group[by_group],
                               np.arange(result.group_deg_idx.size), side="right").tolist()
        members_of = np.split(seq_ids[by_group], ends[:-1])  # [G] original ids per group
        groups, start = [], 0
        for g, j in enumerate(result.group_deg_idx.tolist()):
            groups += _groups_at(start, degrees[j], members_of[g].tolist(), length_list, cost)
            start += degrees[j]
        time_s = cost.fixed_s_per_microbatch + max(g.predicted_time_s for g in groups)
        microbatches.append(MicroBatchPlan(groups=tuple(groups), predicted_time_s=time_s))
    return StepPlan(lengths=tuple(length_list), num_gpus=cost.num_gpus,
                    microbatches=tuple(microbatches),
                    predicted_time_s=sum(mb.predicted_time_s for mb in microbatches))


def _groups_at(start: int, degree: int, members: list[int], lengths: list[int],
               cost: FlexSPCostModel) -> list[SPGroup]:
    """One group, or, when it would hold fewer tokens than ranks (a rank with no token cannot
    run the layers), `degree` single-rank groups taking its sequences one each."""
    seq_lengths = [lengths[i] for i in members]
    if not 0 < sum(seq_lengths) < degree:
        return [SPGroup(start_rank=start, degree=degree, seq_ids=tuple(members),
                        predicted_time_s=cost.group_time_s(seq_lengths, degree))]
    out = []
    for r in range(degree):
        ids = (members[r],) if r < len(members) else ()
        out.append(SPGroup(start_rank=start + r, degree=1, seq_ids=ids,
                           predicted_time_s=cost.group_time_s([lengths[i] for i in ids], 1)))
    return out
