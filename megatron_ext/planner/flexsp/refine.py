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
    group_cap = problem.capacity_tokens * problem.degrees[state.group_deg_idx]  # [G]
    for _ in range(max_rounds):
        g = int(np.argmax(state.loads))
        if not (_best_move(problem, state, g, group_cap) or _best_swap(problem, state, g,
                                                                        group_cap)):
            return


def _apply(problem: MicroBatchProblem, state: Assignment, seq: int, dst: int) -> None:
    src = int(state.seq_group[seq])
    j_src, j_dst = state.group_deg_idx[src], state.group_deg_idx[dst]
    length = int(problem.lengths[seq])
    state.loads[src] -= problem.times[seq, j_src]
    state.tokens[src] -= length
    if state.tokens[src] == 0:
        state.loads[src] = 0.0  # drops the latency term and rounding residue
    if state.tokens[dst] == 0:
        state.loads[dst] += problem.latency_s[j_dst]
    state.loads[dst] += problem.times[seq, j_dst]
    state.tokens[dst] += length
    state.seq_group[seq] = dst


def _best_move(problem: MicroBatchProblem, state: Assignment, g: int,
               group_cap: np.ndarray) -> bool:
    members = np.flatnonzero(state.seq_group == g)  # [m]
    if members.size == 0:
        return False
    c = state.loads[g]
    jg = state.group_deg_idx[g]
    t_src = problem.times[members, jg]  # [m]
    new_src = c - t_src
    if members.size == 1:
        new_src = np.zeros(1)
    t_dst = problem.times[members][:, state.group_deg_idx]  # [m, G]
    empty_lat = np.where(state.tokens == 0, problem.latency_s[state.group_deg_idx], 0.0)  # [G]
    new_dst = state.loads[None, :] + empty_lat[None, :] + t_dst  # [m, G]
    ok = (state.group_deg_idx[None, :] >= problem.min_deg_idx[members, None]) & (
        state.tokens[None, :] + problem.lengths[members, None] <= group_cap[None, :])
    ok[:, g] = False
    value = np.where(ok, np.maximum(new_dst, new_src[:, None]), np.inf)
    flat = int(np.argmin(value))
    if not value.flat[flat] < c * (1 - _REL_EPS):
        return False
    i, h = divmod(flat, value.shape[1])
    _apply(problem, state, int(members[i]), h)
    return True


def _best_swap(problem: MicroBatchProblem, state: Assignment, g: int,
               group_cap: np.ndarray) -> bool:
    in_g = state.seq_group == g
    members, others = np.flatnonzero(in_g), np.flatnonzero(~in_g)  # [m], [n]
    if members.size == 0 or others.size == 0:
        return False
    c = state.loads[g]
    jg = state.group_deg_idx[g]
    h = state.seq_group[others]  # [n]
    jh = state.group_deg_idx[h]  # [n]
    t = problem.times
    new_g = c - t[members, jg][:, None] + t[others, jg][None, :]  # [m, n]
    new_h = (state.loads[h] - t[others, jh])[None, :] + t[members][:, jh]  # [m, n]
    len_m, len_o = problem.lengths[members][:, None], problem.lengths[others][None, :]
    ok = ((jh[None, :] >= problem.min_deg_idx[members, None])
          & (jg >= problem.min_deg_idx[others])[None, :]
          & (state.tokens[g] - len_m + len_o <= group_cap[g])
          & ((state.tokens[h] - problem.lengths[others])[None, :] + len_m <= group_cap[h][None, :]))
    value = np.where(ok, np.maximum(new_g, new_h), np.inf)
    flat = int(np.argmin(value))
    if not value.flat[flat] < c * (1 - _REL_EPS):
        return False
    i, k = divmod(flat, value.shape[1])
    seq_i, seq_k = int(members[i]), int(others[k])
    dst = int(state.seq_group[seq_k])
    _apply(problem, state, seq_k, g)
    _apply(problem, state, seq_i, dst)
    return True
