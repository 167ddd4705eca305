"""Where a layout's memory and time go, stage by stage (`megatron-ext evaluate`).

Built on the same sums as `evaluate` (stage_sums, pipeline_of), so the parts add up to its score:

  memory_k = weights + gradients + optimizer states (the layers' model states, split by
             memory.state_bytes_breakdown) + activations (in-flight micro-batches x what the
             layers keep) + vocabulary (embedding / output layer states, their activations and
             the logits peak) + transient (the largest short-lived buffer: recomputed
             activations, ZeRO-3's gathered weights); the reserve (CUDA context, NCCL,
             fragmentation) comes on top and is what the cap leaves out.
  T_iter   = compute_k + exposed communication_k + optimizer_k + bubble_k on every stage k:
             compute = m (f_k + b_k) minus its exposed communication (recomputation included,
             and shown apart); exposed communication = what the layers, layer switches and
             vocabulary side stream leave exposed per micro-batch, the pipeline messages
             (2 m c_k) and the exposed gradient reduction / parameter all-gather of the tail;
             bubble = the rest of the iteration the stage waits.
The bottleneck is the stage with the longest 1F1B slot (f + b + 2c), which sets the steady state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from megatron_ext.plan import PlanLayout
from megatron_ext.planner.cost.evaluate import Evaluation, evaluate, pipeline_of, stage_sums
from megatron_ext.planner.cost.moe import per_layer_costs, per_layer_weight_grad_bytes
from megatron_ext.planner.space import StrategyTable

if TYPE_CHECKING:
    from megatron_ext.planner.cost.model import CostModel

MEMORY_PARTS = (
    "weights",
    "gradients",
    "optimizer_states",
    "activations",
    "vocabulary",
    "transient",
)
TIME_PARTS = ("compute", "recompute", "exposed_comm", "optimizer", "bubble")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageBreakdown:
    """One pipeline stage."""

    layers: tuple[int, int]
    """Half-open layer range (of the first chunk when the stage holds several)."""
    memory_bytes: dict[str, float]
    """MEMORY_PARTS on one GPU of the stage; they sum to the predicted peak allocation."""
    reserve_bytes: float
    """Kept free on top of the peak (TrainingSpec.reserve_gib)."""
    time_s: dict[str, float]
    """TIME_PARTS per iteration; compute + exposed_comm + optimizer + bubble = iteration
    (recompute is the part of compute spent recomputing)."""
    slot_s: float
    """One 1F1B slot: forward + backward + 2 pipeline messages of one micro-batch."""
    chunks: tuple[tuple[int, int], ...] = ()
    """Layer ranges of every model chunk of the stage (interleaved layouts)."""

    @property
    def label(self) -> str:
        """The stage's layers: `[0, 4)`, or `[0, 2)+[4, 6)` for chunks."""
        return "+".join(f"[{a}, {b})" for a, b in (self.chunks or (self.layers,)))

    @property
    def peak_bytes(self) -> float:
        return float(sum(self.memory_bytes.values()))


@dataclass(frozen=True, kw_only=True, slots=True)
class Breakdown:
    """A layout's score with its per-stage parts."""

    evaluation: Evaluation
    """The exact score (`evaluate`)."""
    stages: tuple[StageBreakdown, ...]
    """One per pipeline stage."""
    memory_cap_bytes: float
    """GPU memory minus the reserve: every stage's peak must stay within it."""
    bottleneck_stage: int
    """The stage with the longest slot."""
    bottleneck: str
    """One line: which stage limits the iteration and by what."""


def breakdown(cm: CostModel, layout: PlanLayout) -> Breakdown:
    """Score a layout with `cm` and split its memory and time per stage (module docstring);
    with virtual_stages > 1 a stage is a pipeline rank with all its chunks."""
    pp, stages, layers = layout.pp, layout.stages, layout.layers
    ev = evaluate(cm, layout)
    sums = stage_sums(cm, layout)
    pipe = pipeline_of(cm, sums)
    arr, ex, m = sums.arr, sums.extras, sums.num_microbatches
    distinct = list(dict.fromkeys(layers))
    table = StrategyTable.of(distinct)
    index = np.array([distinct.index(s) for s in layers], dtype=np.int64)
    costs = per_layer_costs(cm, table, layout.micro_batch_size, index)  # one row per layer
    t = cm.training
    weights, grads = per_layer_weight_grad_bytes(cm, table, index)
    reserve = t.reserve_bytes(cm.cluster.memory_gib)
    iteration = float(ev.iteration_s)
    busy = np.asarray(pipe.stage_busy_s, dtype=float)
    out = []
    v = layout.virtual_stages
    for k in range(pp):
        chunks = [stages[c * pp + k] for c in range(v)]
        ids = np.concatenate([np.arange(s, e) for s, e in chunks])  # per-layer rows
        start = chunks[0][0]
        w_k, g_k = float(weights[ids].sum()), float(grads[ids].sum())
        memory = {
            "weights": w_k,
            "gradients": g_k,
            "optimizer_states": float(costs.state_bytes[ids].sum()) - w_k - g_k,
            "activations": float(arr["act"][k]),
            "vocabulary": float(ex.fixed_bytes[k]),
            "transient": float(costs.transient_bytes[ids].max(initial=0.0)),
        }
        work = m * (arr["f"][k] + arr["b"][k])
        tail = busy[k] - work
        p2p = 2.0 * v * m * float(ex.p2p_s[k])
        exposed = m * arr["comm"][k] + (tail - arr["opt"][k]) + p2p
        time = {
            "compute": float(work - m * arr["comm"][k]),
            "recompute": float(m * arr["rc"][k]),
            "exposed_comm": max(0.0, float(exposed)),  # float noise when nothing is exposed
            "optimizer": float(arr["opt"][k]),
            "bubble": float(max(0.0, iteration - busy[k] - p2p)),
        }
        slot = float(arr["f"][k] + arr["b"][k] + 2 * v * ex.p2p_s[k])
        out.append(
            StageBreakdown(
                layers=(int(start), int(chunks[0][1])),
                chunks=tuple((int(a), int(b)) for a, b in chunks) if v > 1 else (),
                memory_bytes=memory,
                reserve_bytes=float(reserve),
                time_s=time,
                slot_s=slot,
            )
        )
    k = int(np.argmax([s.slot_s for s in out]))
    return Breakdown(
        evaluation=ev,
        stages=tuple(out),
        memory_cap_bytes=float(cm.memory_cap_bytes),
        bottleneck_stage=k,
        bottleneck=_bottleneck(out, k, cm.memory_cap_bytes, iteration),
    )


def _bottleneck(stages: list[StageBreakdown], k: int, cap: float, iteration: float) -> str:
    over = [i for i, s in enumerate(stages) if s.peak_bytes > cap]
    gib = 2**30
    if over:
        worst = max(over, key=lambda i: stages[i].peak_bytes)
        s = stages[worst]
        part = max(s.memory_bytes, key=s.memory_bytes.__getitem__)
        return (
            f"memory: stage {worst} needs {s.peak_bytes / gib:.2f} GiB > {cap / gib:.2f} GiB "
            f"usable (largest part: {part.replace('_', ' ')} "
            f"{s.memory_bytes[part] / gib:.2f} GiB)"
        )
    s = stages[k]
    parts = {
        "compute": s.time_s["compute"] - s.time_s["recompute"],
        "recomputation": s.time_s["recompute"],
        "exposed communication": s.time_s["exposed_comm"],
        "optimizer step": s.time_s["optimizer"],
    }
    top = max(parts, key=parts.__getitem__)
    busy = iteration - s.time_s["bubble"]
    share = parts[top] / busy if busy > 0 else 0.0
    head = f"stage {k}" if len(stages) > 1 else "the only stage"
    return (
        f"{head} (layers {s.label}) has the longest pipeline slot "
        f"({s.slot_s:.4g} s per micro-batch); {top} is {100 * share:.0f}% of its busy time"
    )
