"""Local search on an Assignment: shorten the slowest group by one move or one swap at a time.

Each round looks at the slowest group g (time C) and evaluates, with numpy over all candidates:
- moves: one of g's sequences to any other group h that can hold it; new makespan of the pair
  max(C - t_g(i), load_h + t_h(i));
- swaps: one of g's sequences i with any sequence k of another group h;
  max(C - t_g(i) + t_g(k), load_h - t_h(k) + t_h(i)).
The best candidate is applied if it brings the pair strictly below C; the search stops when the
slowest group has no improving candidate (a local optimum) or after `max_rounds`.
Latency terms are charged when a group turns non-empty and refunded when it empties.
"""

from __future__ import annotations

import numpy as np

from megatron_ext.planner.flexsp.assign import Assignment, MicroBatchProblem

_REL_EPS = 1e-9


def refine(problem: MicroBatchProblem, state: Assignment, *, max_rounds: int = 200) -> None:
    """Improve `state` in place (never makes the makespan worse)."""
    ctx = _Context(problem, state)
    for _ in range(max_rounds):
        g = int(np.argmax(state.loads))
        if not (_best_move(ctx, g) or _best_swap(ctx, g)):
            return


class _Context:
    """Per-refinement constants, gathered once: each sequence's time in each concrete group."""

    __slots__ = ("allowed", "empty_lat", "group_cap", "problem", "state", "tg")

    def __init__(self, problem: MicroBatchProblem, state: Assignment) -> None:
        j = state.group_deg_idx  # [G]
        self.problem, self.state = problem, state
        self.group_cap = problem.capacity_tokens * problem.degrees[j]  # [G]
        self.tg = problem.times[:, j]  # [K, G]: time of each sequence in each group
        self.allowed = j[None, :] >= problem.min_deg_idx[:, None]  # [K, G]: memory allows it
        self.empty_lat = problem.latency_s[j]  # [G]: latency a group pays once non-empty


def _apply(ctx: _Context, seq: int, dst: int) -> None:
    state, problem = ctx.state, ctx.problem
    src = int(state.seq_group[seq])
    length = int(problem.lengths[seq])
    state.loads[src] -= ctx.tg[seq, src]
    state.tokens[src] -= length
    if state.tokens[src] == 0:
        state.loads[src] = 0.0  # drops the latency term and rounding residue
    if state.tokens[dst] == 0:
        state.loads[dst] += ctx.empty_lat[dst]
    state.loads[dst] += ctx.tg[seq, dst]
    state.tokens[dst] += length
    state.seq_group[seq] = dst


def _best_move(ctx: _Context, g: int) -> bool:
    state, problem = ctx.state, ctx.problem
    members = np.flatnonzero(state.seq_group == g)  # [m]
    if members.size == 0:
        return False
    c = state.loads[g]
    t_members = ctx.tg[members]  # [m, G]
    new_src = c - t_members[:, g] if members.size > 1 else np.zeros(1)  # [m]
    empty_lat = np.where(state.tokens == 0, ctx.empty_lat, 0.0)  # [G]
    new_dst = (state.loads + empty_lat)[None, :] + t_members  # [m, G]
    ok = ctx.allowed[members] & (
        (state.tokens - ctx.group_cap)[None, :] + problem.lengths[members, None] <= 0)
    ok[:, g] = False
    value = np.where(ok, np.maximum(new_dst, new_src[:, None]), np.inf)
    flat = int(np.argmin(value))
    if not value.flat[flat] < c * (1 - _REL_EPS):
        return False
    i, h = divmod(flat, value.shape[1])
    _apply(ctx, int(members[i]), h)
    return True


def _best_swap(ctx: _Context, g: int) -> bool:
    state, problem = ctx.state, ctx.problem
    in_g = state.seq_group == g
    members = np.flatnonzero(in_g)  # [m]
    if members.size == 0:
        return False
    # g only gets faster by taking a shorter sequence than it gives (times grow with length)
    others = np.flatnonzero(~in_g & (problem.lengths < problem.lengths[members[0]]))  # [n]
    if others.size == 0:
        return False
    c = state.loads[g]
    h = state.seq_group[others]  # [n]
    tg = ctx.tg
    t_m = tg[members]  # [m, G]
    new_g = (c - t_m[:, g])[:, None] + tg[others, g][None, :]  # [m, n]
    new_h = (state.loads[h] - tg[others, h])[None, :] + t_m[:, h]  # [m, n]
    len_m, len_o = problem.lengths[members][:, None], problem.lengths[others][None, :]
    ok = (ctx.allowed[members][:, h]
          & ctx.allowed[others, g][None, :]
          & (state.tokens[g] - len_m + len_o <= ctx.group_cap[g])
          & ((state.tokens[h] - ctx.group_cap[h] - problem.lengths[others])[None, :] + len_m
             <= 0))
    value = np.where(ok, np.maximum(new_g, new_h), np.inf)
    flat = int(np.argmin(value))
    if not value.flat[flat] < c * (1 - _REL_EPS):
        return False
    i, k = divmod(flat, value.shape[1])
    seq_i, seq_k = int(members[i]), int(others[k])
    dst = int(state.seq_group[seq_k])
    _apply(ctx, seq_k, g)
    _apply(ctx, seq_i, dst)
    return True
