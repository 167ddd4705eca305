"""Exact score of one complete layout: per-stage memory and time, 1F1B iteration time, MFU.

Both searches rank their finalists with `evaluate`, and the plan's `prediction` is its output, so
the heterogeneous and the uniform results are compared on the same formula. The stage sums are
(legend as in cost/model.py and cost/vocab.py):

  f_k   = sum_layers forward + half the layer-switch costs + vocabulary forward
  b_k   = sum_layers backward + half the switch costs + vocabulary backward
          + max(0, slow * side-stream vocabulary comm - sum_layers (forward + backward))
  mem_k = vocabulary bytes + sum_layers (states + inflight_k * activations)
          + max_layers transient                 (must stay <= memory - reserve)

Interleaved layouts (virtual_stages v > 1: pp * v chunks, chunk c of stage k is
stages[c * pp + k]) sum every quantity over stage k's chunks, except activations: they are
max over the schedule's forwards of sum_c inflight[t, k, c] * activations of chunk c
(cost/pipeline.py interleaved_inflight), and the schedule is priced by one_f_one_b with v.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from megatron_ext.errors import PlanError
from megatron_ext.plan import ParallelPlan, PlanLayout, Prediction
from megatron_ext.planner.cost.compute import model_flops_per_token
from megatron_ext.planner.cost.moe import per_layer_costs
from megatron_ext.planner.cost.pipeline import (
    PipelineTime,
    interleaved_inflight,
    mfu,
    one_f_one_b,
)
from megatron_ext.planner.cost.vocab import StageExtras, stage_extras
from megatron_ext.planner.space import StrategyTable
from megatron_ext.planner.training import DEFAULT_MOE_IMBALANCE, Engine, TrainingSpec

if TYPE_CHECKING:
    from megatron_ext.planner.cost.model import CostModel

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
    """The sums by name (also "act": activation bytes at the stage's peak)."""
    extras: StageExtras
    """cost/vocab.py stage_extras of this layout."""
    num_microbatches: int
    """Micro-batches per iteration."""
    virtual_stages: int = 1
    """Model chunks per stage (interleaved schedule when > 1)."""
    max_zero: int = 0
    """The highest ZeRO stage of the layers."""


def stage_sums(cm: CostModel, layout: PlanLayout) -> StageSums:
    """The per-stage sums `evaluate` scores (also read by planner.profile.cost.stage_work)."""
    pp, stages, layers = layout.pp, layout.stages, layout.layers
    micro_batch_size, v = layout.micro_batch_size, layout.virtual_stages
    distinct = list(dict.fromkeys(layers))
    table = StrategyTable.of(distinct)
    index = np.array([distinct.index(s) for s in layers], dtype=np.int64)
    costs = per_layer_costs(cm, table, micro_batch_size, index)  # one row per layer
    switch = cm.transition_s(table, micro_batch_size)
    m = cm.training.global_batch_size // micro_batch_size
    vocab_zero = 1 if any(s.zero >= 1 for s in distinct) else 0
    ex = stage_extras(cm, layout.vocab, pp, micro_batch_size, m, vocab_zero,
                      virtual_stages=v)
    names = ("f", "b", "sync", "gather", "opt", "mem", "rc", "comm", "act")
    arr = {k: np.zeros(pp) for k in names}
    chunk_act = np.zeros((pp, v))
    transient = np.zeros(pp)
    for j, (start, end) in enumerate(stages):
        k = j % pp
        ids = index[start:end]
        sw = float(switch[ids[:-1], ids[1:]].sum()) / 2
        ids = np.arange(start, end)  # rows of the per-layer costs
        arr["f"][k] += costs.forward_s[ids].sum() + sw
        arr["b"][k] += costs.backward_s[ids].sum() + sw
        arr["sync"][k] += costs.grad_sync_s[ids].sum()
        arr["gather"][k] += costs.param_gather_s[ids].sum()
        arr["opt"][k] += costs.optimizer_s[ids].sum()
        arr["mem"][k] += costs.state_bytes[ids].sum()
        arr["rc"][k] += costs.recompute_s[ids].sum()
        arr["comm"][k] += costs.comm_s[ids].sum() + 2 * sw
        chunk_act[k, j // pp] = costs.activation_bytes[ids].sum()
        # a stage may hold no layer
        transient[k] = max(transient[k], costs.transient_bytes[ids].max(initial=0.0))
    if v == 1:
        arr["act"] = ex.inflight * chunk_act[:, 0]
    else:
        counts = interleaved_inflight(pp, m, v)  # [T, pp, v]
        arr["act"] = (counts * chunk_act[None]).sum(axis=-1).max(axis=0)
    for k in range(pp):
        layer_work = arr["f"][k] + arr["b"][k]
        exposed = max(0.0, cm.overlap_slowdown * ex.overlap_comm_s[k] - layer_work)
        arr["f"][k] += ex.forward_s[k]
        arr["b"][k] += ex.backward_s[k]
        arr["b"][k] += exposed
        arr["comm"][k] += exposed
        arr["sync"][k] += ex.grad_sync_s[k]
        arr["gather"][k] += ex.param_gather_s[k]
        arr["opt"][k] += ex.optimizer_s[k]
        if v == 1:  # the same sum in the same order as before virtual stages existed
            start, end = stages[k]
            arr["mem"][k] = (ex.fixed_bytes[k]
                             + costs.memory_bytes(int(ex.inflight[k]))[start:end].sum()
                             + transient[k])
        else:
            arr["mem"][k] += ex.fixed_bytes[k] + arr["act"][k] + transient[k]
    if v > 1 and cm.training.overlap_p2p_comm:
        ex = dataclasses.replace(ex, p2p_s=overlapped_p2p_s(ex.p2p_s, arr["f"], v))
    return StageSums(arr=arr, extras=ex, num_microbatches=m, virtual_stages=v,
                     max_zero=max((s.zero for s in distinct), default=0))


def overlapped_p2p_s(p2p_s: np.ndarray, forward_s: np.ndarray, v: int) -> np.ndarray:
    """What a pipeline message leaves exposed under Megatron's interleaved schedule with
    overlap_p2p_comm (megatron-core pipeline_parallel/schedules.py: each chunk's sends and
    receives are posted asynchronously and waited on before the chunk that needs them): what
    outlasts the chunk's forward it runs beside (the shorter pass, f_k / v)."""
    return np.maximum(0.0, p2p_s - forward_s / v)


def plan_training(plan: ParallelPlan, *, flash_attention: bool = True, dropout: bool = True,
                  engine: Engine = "megatron", moe_imbalance: float | None = None,
                  overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                  tp_comm_overlap: bool = False, overlap_p2p_comm: bool = False
                  ) -> TrainingSpec:
    """The training settings a plan is scored with (`megatron-ext evaluate` and the published
    runs' benchmark, megatron_ext/calibration): its batch, sequence, precision and overlap flags
    (plan.overlap_grad_reduce / overlap_param_gather, or the arguments' when they turn one on),
    and how the run executes, which the plan does not record (--no-flash-attention,
    --no-dropout, --engine, --megatron-p2p-overlap). `tp_comm_overlap` turns
    plan.tp_comm_overlap on under the plan's own rule (plan_checks: a layer with tp > 1 and sp,
    sp wherever tp > 1)."""
    if tp_comm_overlap and not plan.tp_comm_overlap:
        dataclasses.replace(plan, tp_comm_overlap=True)  # raises the plan's one-line refusal
    if engine == "deepspeed-bf16":  # BF16_Optimizer splits the optimizer, nothing more
        for i, s in enumerate(plan.layers):
            if s.zero >= 2 or (s.zero == 0 and s.dp * s.cp * s.ulysses > 1):
                raise PlanError(
                    f"layers[{i}].zero={s.zero}: --engine deepspeed-bf16 (DeepSpeed's "
                    "BF16_Optimizer) splits the optimizer states over the data-parallel ranks and "
                    "nothing else; set zero 1 (--use-distributed-optimizer) or use --engine "
                    "deepspeed")
    return TrainingSpec(
        global_batch_size=plan.global_batch_size,
        seq_length=plan.seq_length,
        precision=plan.precision,
        fp8=plan.fp8,
        allow_zero3=any(s.zero >= 2 for s in plan.layers),
        flash_attention=flash_attention,
        dropout=dropout,
        engine=engine,
        overlap_grad_reduce=overlap_grad_reduce or plan.overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather or plan.overlap_param_gather,
        tp_comm_overlap=tp_comm_overlap or plan.tp_comm_overlap,
        overlap_p2p_comm=overlap_p2p_comm,
        moe_imbalance=DEFAULT_MOE_IMBALANCE if moe_imbalance is None else moe_imbalance,
    )


def evaluate(cm: CostModel, layout: PlanLayout) -> Evaluation:
    """Score a layout with CostModel `cm` (see the module docstring)."""
    sums = stage_sums(cm, layout)
    return _finish(cm, pipeline_of(cm, sums), sums.arr, sums.extras, sums.num_microbatches,
                   sums.virtual_stages)


def pipeline_of(cm: CostModel, sums: StageSums) -> PipelineTime:
    """The 1F1B schedule of the stage sums (what `evaluate` scores; cost/breakdown.py reads it
    too). The gradient reduction and ZeRO-1's weight all-gather overlap compute only as
    TrainingSpec.overlap_grad_reduce / overlap_param_gather say (Megatron-LM's flags, off by
    default; DeepSpeed's engine at ZeRO 0-1 never overlaps them; ZeRO-3's per-micro-batch
    traffic is priced in the layers, not here)."""
    arr, ex = sums.arr, sums.extras
    sync, gather, opt = arr["sync"], arr["gather"], arr["opt"]
    return one_f_one_b(
        arr["f"],
        arr["b"],
        ex.p2p_s,
        sync,
        gather,
        opt,
        sums.num_microbatches,
        overlap_slowdown=cm.overlap_slowdown,
        virtual_stages=sums.virtual_stages,
        overlap_grad_reduce=cm.training.overlap_grad_reduce,
        overlap_param_gather=cm.training.overlap_param_gather,
    )


def _finish(cm: CostModel, pipe: PipelineTime, arr: dict[str, np.ndarray], ex: StageExtras, m: int,
            v: int = 1) -> Evaluation:
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
        "p2p_s": float(2 * v * m * ex.p2p_s[busiest]),
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
