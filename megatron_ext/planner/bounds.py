"""Lower bounds on a layout's iteration time, used to skip whole (pp, micro-batch) combos.

A bound may only ever be lower than the exact score of every layout in the combo (cost/evaluate.py),
so skipping a combo whose bound reaches the best score found cannot lose the optimum.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_ext.planner.cost.model import CostModel, LayerCosts
from megatron_ext.planner.cost.pipeline import pipeline_lower_bound_s


def combo_bound(cm: CostModel, costs: LayerCosts, pp: int, mbs: int,
                valid: np.ndarray | None = None) -> float:
    """Lower bound of any layout's iteration time at (pp, micro-batch size), inf if none fits.

    Relaxation: all L layers share the pp stages' total memory (each stage keeps at least one
    micro-batch of activations), strategies may be mixed fractionally, vocabulary work is at least
    the output GEMM of one replica's micro-batch at the best GEMM efficiency, and 1F1B needs at
    least (m + pp - 1) / pp of the total per-micro-batch work."""
    model, t = cm.model, cm.training
    mem = costs.state_bytes + costs.activation_bytes
    time_s = costs.forward_s + costs.backward_s
    if valid is not None:  # strategies this model's layers may not use (cost/moe.py valid_for)
        mem, time_s = np.where(valid, mem, np.inf), np.where(valid, time_s, np.inf)
    per_layer = lp_min_time(mem, time_s, pp * cm.memory_cap_bytes / model.num_layers)
    work = model.num_layers * per_layer + _vocab_s(cm, pp, mbs)
    return pipeline_lower_bound_s(work, pp, t.global_batch_size // mbs)


def _vocab_s(cm: CostModel, pp: int, mbs: int) -> float:
    model, t = cm.model, cm.training
    width = cm.cluster.num_gpus // pp
    vocab_flops = 6.0 * mbs * t.seq_length * model.hidden_size * model.vocab_size / width
    return vocab_flops / (cm.cluster.peak_flops * cm.compute.gemm_efficiency)


def combo_bound_kinds(
    cm: CostModel, costs: list[LayerCosts], valid: np.ndarray, counts: list[int], pp: int,
    mbs: int,
) -> float:
    """combo_bound for models with n_k layers of each kind k (MoE: dense and MoE layers). The
    LP min sum_k n_k sum_s w_ks t_ks subject to sum_k n_k sum_s w_ks m_ks <= pp * cap is bounded
    from below by its Lagrangian dual: for every lambda >= 0,
    sum_k n_k min_s (t_ks + lambda m_ks) - lambda pp cap; the bound is the best lambda of a grid
    (any lambda is valid), inf when even the smallest memory of every layer does not fit."""
    t = cm.training
    budget = pp * cm.memory_cap_bytes
    mems = [np.where(ok, c.state_bytes + c.activation_bytes, np.inf) for c, ok in zip(costs, valid)]
    times = [np.where(ok, c.forward_s + c.backward_s, np.inf) for c, ok in zip(costs, valid)]
    if sum(n * float(np.min(mm)) for n, mm in zip(counts, mems)) > budget:
        return math.inf
    fastest = sum(n * float(np.min(tt)) for n, tt in zip(counts, times))
    scale = fastest / budget
    best = fastest - 0.0  # lambda = 0
    for lam in scale * np.geomspace(1e-3, 1e3, 61):
        value = sum(n * float(np.min(tt + lam * mm)) for n, tt, mm in zip(counts, times, mems))
        best = max(best, value - lam * budget)
    work = best + _vocab_s(cm, pp, mbs)
    return pipeline_lower_bound_s(work, pp, t.global_batch_size // mbs)


def lp_min_time(mem: np.ndarray, time_s: np.ndarray, mean_mem: float) -> float:
    """min of sum_s w_s time_s over weights w >= 0, sum w = 1, sum w_s mem_s <= mean_mem: the
    lower convex hull of (mem, time) at mean_mem (inf if every strategy needs more memory)."""
    fits = mem <= mean_mem
    if not np.any(fits):
        return math.inf
    best = float(np.min(time_s[fits]))
    lo, hi = np.flatnonzero(fits), np.flatnonzero(~fits & np.isfinite(mem) & np.isfinite(time_s))
    if len(hi):
        m_lo, t_lo = mem[lo][:, None], time_s[lo][:, None]
        m_hi, t_hi = mem[hi][None, :], time_s[hi][None, :]
        mix = t_lo + (t_hi - t_lo) * (mean_mem - m_lo) / (m_hi - m_lo)  # [lo, hi]
        best = min(best, float(mix.min()))
    return best
