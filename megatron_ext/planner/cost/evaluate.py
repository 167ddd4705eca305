"""Exact score of one complete layout: per-stage memory and time, 1F1B iteration time, MFU.

Both searches rank their finalists with `evaluate`, and the plan's `prediction` is its output, so
the heterogeneous and the uniform results are compared on the same formula. The stage sums are
(legend as in cost/model.py and cost/vocab.py):

  f_k   = sum_layers forward + half the layer-switch costs + vocabulary forward
  b_k   = sum_layers backward + half the switch costs + vocabulary backward
          + max(0, slow * side-stream vocabulary comm - sum_layers (forward + backward))
  mem_k = vocabulary bytes + sum_layers (states + inflight_k * activations)
          + max_layers transient                 (must stay <= memory - reserve)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_ext.plan import LayerStrategy, Prediction, VocabStrategy
from megatron_ext.planner.cost.compute import model_flops_per_token
from megatron_ext.planner.cost.pipeline import PipelineTime, mfu, one_f_one_b
from megatron_ext.planner.cost.vocab import stage_extras
from megatron_ext.planner.space import StrategyTable

GIB = 2**30


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluation:
    """Predicted performance of one layout."""

    iteration_s: float
    """Seconds per optimizer step."""
    tokens_per_s: float
    """global_batch_size * seq_length / iteration_s."""
    mfu: float
    """Model FLOPs utilisation."""
    stage_peak_bytes: tuple[float, ...]
    """Predicted peak allocated memory per stage (the fixed reserve excluded)."""
    stage_busy_s: tuple[float, ...]
    """Seconds each stage computes or runs its own gradient tail per iteration."""
    feasible: bool
    """Every stage fits in memory minus the reserve."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per iteration on the busiest stage by cause (for --explain)."""

    def prediction(self) -> Prediction:
        return Prediction(
            iteration_time_s=self.iteration_s,
            tokens_per_s=self.tokens_per_s,
            mfu=self.mfu,
            stage_peak_memory_gib=tuple(round(b / GIB, 3) for b in self.stage_peak_bytes),
            stage_time_s=tuple(round(t, 6) for t in self.stage_busy_s),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSums:
    """Per-stage sums of one micro-batch (arrays [pp]: f, b, sync, gather, opt, mem, rc, comm;
    see the module docstring) with the vocabulary extras they include."""

    arr: dict[str, np.ndarray]
    """The sums by name."""
    extras: Any
    """cost/vocab.py stage_extras of this layout."""
    num_microbatches: int
    """Micro-batches per iteration."""


def stage_sums(
    cm,
    *,
    pp: int,
    stages: tuple[tuple[int, int], ...] | list[tuple[int, int]],
    layers: tuple[LayerStrategy, ...] | list[LayerStrategy],
    vocab: VocabStrategy,
    micro_batch_size: int,
) -> StageSums:
    """The per-stage sums `evaluate` scores (also read by planner.profile.cost.stage_work)."""
    distinct = list(dict.fromkeys(layers))
    table = StrategyTable.of(distinct)
    index = np.array([distinct.index(s) for s in layers], dtype=np.int64)
    costs = cm.layer_costs(table, micro_batch_size)
    switch = cm.transition_s(table, micro_batch_size)
    m = cm.training.global_batch_size // micro_batch_size
    vocab_zero = 1 if any(s.zero >= 1 for s in distinct) else 0
    ex = stage_extras(cm, vocab, pp, micro_batch_size, m, vocab_zero)
    arr = {k: np.zeros(pp) for k in ("f", "b", "sync", "gather", "opt", "mem", "rc", "comm")}
    for k, (start, end) in enumerate(stages):
        ids = index[start:end]
        sw = float(switch[ids[:-1], ids[1:]].sum()) / 2
        layer_work = float((costs.forward_s[ids] + costs.backward_s[ids]).sum())
        exposed = max(0.0, cm.overlap_slowdown * ex.overlap_comm_s[k] - layer_work)
        arr["f"][k] = costs.forward_s[ids].sum() + sw + ex.forward_s[k]
        arr["b"][k] = costs.backward_s[ids].sum() + sw + ex.backward_s[k] + exposed
        arr["sync"][k] = costs.grad_sync_s[ids].sum() + ex.grad_sync_s[k]
        arr["gather"][k] = costs.param_gather_s[ids].sum() + ex.param_gather_s[k]
        arr["opt"][k] = costs.optimizer_s[ids].sum() + ex.optimizer_s[k]
        arr["mem"][k] = (
            ex.fixed_bytes[k]
            + costs.memory_bytes(int(ex.inflight[k]))[ids].sum()
            + costs.transient_bytes[ids].max(initial=0.0)  # a stage may hold no layer
        )
        arr["rc"][k] = costs.recompute_s[ids].sum()
        arr["comm"][k] = costs.comm_s[ids].sum() + 2 * sw + exposed
    return StageSums(arr=arr, extras=ex, num_microbatches=m)


def evaluate(
    cm,
    *,
    pp: int,
    stages: tuple[tuple[int, int], ...] | list[tuple[int, int]],
    layers: tuple[LayerStrategy, ...] | list[LayerStrategy],
    vocab: VocabStrategy,
    micro_batch_size: int,
) -> Evaluation:
    """Score a layout with CostModel `cm` (see the module docstring)."""
    sums = stage_sums(cm, pp=pp, stages=stages, layers=layers, vocab=vocab,
                      micro_batch_size=micro_batch_size)
    return _finish(cm, pipeline_of(cm, sums), sums.arr, sums.extras, sums.num_microbatches)


def pipeline_of(cm, sums: StageSums) -> PipelineTime:
    """The 1F1B schedule of the stage sums (what `evaluate` scores; cost/breakdown.py reads it
    too)."""
    arr, ex = sums.arr, sums.extras
    return one_f_one_b(
        arr["f"],
        arr["b"],
        ex.p2p_s,
        arr["sync"],
        arr["gather"],
        arr["opt"],
        sums.num_microbatches,
        overlap_slowdown=cm.overlap_slowdown,
    )


def _finish(cm, pipe, arr: dict[str, np.ndarray], ex, m: int) -> Evaluation:
    t = cm.training
    iteration = float(pipe.iteration_s)
    tokens_per_s = t.global_batch_size * t.seq_length / iteration
    busiest = int(np.argmax(pipe.stage_busy_s))
    flops = model_flops_per_token(cm.model, t.seq_length)
    breakdown = {
        "compute_s": float(
            m * (arr["f"][busiest] + arr["b"][busiest])
            - m * (arr["rc"][busiest] + arr["comm"][busiest])
        ),
        "recompute_s": float(m * arr["rc"][busiest]),
        "exposed_comm_s": float(m * arr["comm"][busiest]),
        "pipeline_bubble_s": float(pipe.bubble_s),
        "tail_s": float(pipe.stage_busy_s[busiest] - m * (arr["f"][busiest] + arr["b"][busiest])),
        "p2p_s": float(2 * m * ex.p2p_s[busiest]),
    }
    return Evaluation(
        iteration_s=iteration,
        tokens_per_s=tokens_per_s,
        mfu=mfu(tokens_per_s, flops, cm.cluster.num_gpus, cm.cluster.peak_flops),
        stage_peak_bytes=tuple(float(x) for x in arr["mem"]),
        stage_busy_s=tuple(float(x) for x in pipe.stage_busy_s),
        feasible=bool(np.all(arr["mem"] <= cm.memory_cap_bytes)),
        breakdown=breakdown,
    )
