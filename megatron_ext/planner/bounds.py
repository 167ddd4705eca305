"""Lower bounds on a layout's iteration time, used to skip whole (pp, micro-batch) combos.

A bound may only ever be lower than the exact score of every layout in the combo (cost/evaluate.py),
so skipping a combo whose bound reaches the best score found cannot lose the optimum.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_ext.planner.cost.model import CostModel, LayerCosts
from megatron_ext.planner.cost.pipeline import pipeline_lower_bound_s


def combo_bound(cm: CostModel, costs: LayerCosts, pp: int, mbs: int) -> float:
    """Lower bound of any layout's iteration time at (pp, micro-batch size), inf if none fits.

    Relaxation: all L layers share the pp stages' total memory (each stage keeps at least one
    micro-batch of activations), strategies may be mixed fractionally, vocabulary work is at least
    the output GEMM of one replica's micro-batch at the best GEMM efficiency, and 1F1B needs at
    least (m + pp - 1) / pp of the total per-micro-batch work."""
    model, t = cm.model, cm.training
    per_layer = lp_min_time(
        costs.state_bytes + costs.activation_bytes,
        costs.forward_s + costs.backward_s,
        pp * cm.memory_cap_bytes / model.num_layers,
    )
    width = cm.cluster.num_gpus // pp
    vocab_flops = 6.0 * mbs * t.seq_length * model.hidden_size * model.vocab_size / width
    vocab_s = vocab_flops / (cm.cluster.peak_flops * cm.compute.gemm_efficiency)
    work = model.num_layers * per_layer + vocab_s
    return pipeline_lower_bound_s(work, pp, t.global_batch_size // mbs)


def lp_min_time(mem: np.ndarray, time_s: np.ndarray, mean_mem: float) -> float:
    """min of sum_s w_s time_s over weights w >= 0, sum w = 1, sum w_s mem_s <= mean_mem: the
    lower convex hull of (mem, time) at mean_mem (inf if every strategy needs more memory)."""
    fits = mem <= mean_mem
    if not np.any(fits):
        return math.inf
    best = float(np.min(time_s[fits]))
    lo, hi = np.flatnonzero(fits), np.flatnonzero(~fits)
    if len(hi):
        m_lo, t_lo = mem[lo][:, None], time_s[lo][:, None]
        m_hi, t_hi = mem[hi][None, :], time_s[hi][None, :]
        mix = t_lo + (t_hi - t_lo) * (mean_mem - m_lo) / (m_hi - m_lo)  # [lo, hi]
        best = min(best, float(mix.min()))
    return best
