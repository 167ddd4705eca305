"""The planner's cost model fed by measured profiles (megatron_ext/planner/profile/profiles.py).

- Communication: a ClusterProfile implements the planner's `CommModel` protocol directly
  (`time_s(collective, num_bytes, layout)`), so `CostModel(comm=cluster_profile)` uses measured
  curves everywhere the formulas were used.
- Kernel efficiencies: `fitted_compute_profile` turns a ModelProfile into the planner's
  `ComputeProfile` (GEMM efficiency from the output layer's measured FLOP rate, attention
  efficiencies from the layer fit, memory bandwidth from the optimizer step), which is what the
  vocabulary layers and the optimizer term read.
- Transformer layers: `ProfiledCostModel.layer_costs` replaces the analytic per-layer compute
  (forward, backward, full and selective recomputation) with the model profile's fitted times and
  keeps every communication term of the base model.
- Shared compute (`ProfiledCostModel.shared_iteration_s`): the planner's pipeline formula
  assumes a device per rank. When ranks share compute (CPU cores), model-profile times are of a
  rank alone and S ranks per node compute at that speed at once (measured on the model:
  concurrency / sharing_slowdown). `stage_work` splits each stage's per-micro-batch time into
  compute and exposed communication, and planner/profile/pipeline.py plays the 1F1B schedule out
  with
  n computing ranks running at min(1, S / n) of their solo speed (fill and drain near solo
  speed, steady state shared; communication unshared). With a device per rank (no sharing
  measured) the prediction is the planner's iteration time.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatron_ext.errors import PlanError
from megatron_ext.plan import PlanLayout
from megatron_ext.planner.cost import compute as C
from megatron_ext.planner.cost.comm import CommModel
from megatron_ext.planner.cost.evaluate import evaluate, stage_sums
from megatron_ext.planner.cost.model import CostModel, LayerCosts
from megatron_ext.planner.cost.pipeline import gradient_tail_s
from megatron_ext.planner.profile.pipeline import StageWork, shared_one_f_one_b_s
from megatron_ext.planner.profile.profiles import ModelProfile
from megatron_ext.planner.space import StrategyTable
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.specs import ClusterSpec, ModelSpec

ADAM_BYTES_PER_PARAM = 30.0
"""HBM bytes per parameter the planner's optimizer term assumes (compute.optimizer_step_s)."""


def fitted_compute_profile(profile: ModelProfile, cluster: ClusterSpec) -> C.ComputeProfile:
    """Planner kernel efficiencies that reproduce the profile's measured rates on `cluster`
    (peak = cluster.peak_flops, taken as the peak of the profile's precision)."""
    base = C.ComputeProfile()
    peak = cluster.peak_flops
    # The profile's measured layer and step times already contain the host side.
    fields: dict[str, float] = {"fp32_flops_ratio": 1.0, "gemm_half_dim": 1e-6,
                                "host_kernel_s": 0.0, "host_collective_step_s": 0.0,
                                "host_microbatch_s": 0.0}
    out_fit = profile.fits.get("output_forward_s")
    if out_fit is not None:  # seconds per output-GEMM FLOP (feature 1 = n h V_t = FLOPs / 2)
        per_flop = out_fit.coef[1] / out_fit.scale[1] / 2.0
        fields["gemm_efficiency"] = _efficiency(per_flop, peak, base.gemm_efficiency)
    layer_fwd, layer_bwd = profile.fits["forward_s"], profile.fits["backward_s"]
    fields["attention_efficiency"] = _efficiency(
        layer_fwd.coef[2] / layer_fwd.scale[2], peak, base.attention_efficiency)
    fields["attention_backward_efficiency"] = _efficiency(
        layer_bwd.coef[2] / layer_bwd.scale[2] / 2.5, peak, base.attention_backward_efficiency)
    opt_fit = profile.fits.get("optimizer_step_s")
    if opt_fit is not None and opt_fit.coef[1] > 0:
        per_param = opt_fit.coef[1] / opt_fit.scale[1]
        fields["hbm_bytes_per_s"] = ADAM_BYTES_PER_PARAM / per_param
    return dataclasses.replace(base, **fields)


def _efficiency(seconds_per_flop: float, peak_flops: float, default: float) -> float:
    if not seconds_per_flop > 0:
        return default
    return float(min(1.0, 1.0 / (seconds_per_flop * peak_flops)))


class ProfiledCostModel(CostModel):
    """CostModel with measured communication and measured per-layer compute."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *,
                 comm: CommModel | None = None, model_profile: ModelProfile | None = None,
                 compute: C.ComputeProfile | None = None) -> None:
        """As CostModel; `comm` is typically a ClusterProfile, `model_profile` replaces the
        layer compute and the kernel efficiencies (None: the analytic ones, or `compute`'s)."""
        if model_profile is not None and model_profile.model != model:
            raise PlanError(f"the model profile was measured on model {model_profile.model.name!r}"
                            f" with a different shape than {model.name!r}; profile this model")
        if model_profile is not None:
            compute = fitted_compute_profile(model_profile, cluster)
        super().__init__(model, cluster, training, comm=comm, compute=compute)
        self.model_profile = model_profile

    def layer_costs(self, table: StrategyTable, micro_batch_size: int) -> LayerCosts:
        costs = super().layer_costs(table, micro_batch_size)
        prof = self.model_profile
        if prof is None:
            return costs
        t = self.training
        b = micro_batch_size / table.dp
        shards = table.cp * table.ulysses
        analytic = C.layer_compute(self.model, self.cluster, self.compute, b=b,
                                   seq_length=t.seq_length, tp=table.tp, sp=table.sp,
                                   seq_shards=shards, element_bytes=self.element_bytes,
                                   flash_attention=t.flash_attention,
                                   fused_softmax=self.fused_softmax(table, b))
        kw = {"tp": table.tp, "sp": table.sp, "micro_batch_size": b,
              "seq_length": t.seq_length, "seq_shards": shards}
        fwd, bwd = prof.layer_time_s("forward_s", **kw), prof.layer_time_s("backward_s", **kw)
        full, selective = table.recompute == 2, table.recompute == 1
        old_rc = (np.where(full, analytic.forward_s, 0.0)
                  + np.where(selective, analytic.attention_forward_s, 0.0))
        new_rc = (np.where(full, prof.layer_time_s("recompute_s", **kw), 0.0)
                  + np.where(selective, prof.layer_time_s("selective_recompute_s", **kw), 0.0))
        changes = {
            "forward_s": costs.forward_s - analytic.forward_s + fwd,
            "backward_s": costs.backward_s - analytic.backward_s + bwd - old_rc + new_rc,
            "recompute_s": costs.recompute_s - old_rc + new_rc,
        }
        act = prof.activation_bytes(tp=table.tp, sp=table.sp, micro_batch_size=b,
                                    seq_length=t.seq_length)
        if act is not None:
            changes["activation_bytes"] = np.where(table.recompute == 0, act,
                                                   costs.activation_bytes)
        return dataclasses.replace(costs, **changes)

    def compute_slots_per_node(self) -> float | None:
        """Ranks of a node that compute at full speed at once: measured on the model itself when
        the model profile was taken with ranks sharing the device (concurrency / slowdown), else
        the cluster profile's matmul measurement, else None (a device per rank)."""
        prof = self.model_profile
        if prof is not None and prof.concurrency > 1:
            return prof.concurrency / prof.sharing_slowdown
        return getattr(self.comm, "compute_slots_per_node", None)

    def shared_iteration_s(self, layout: PlanLayout) -> float | None:
        """Iteration time of a layout when ranks share compute (planner.profile.pipeline's 1F1B
        simulation on `compute_slots_per_node` slots per node), None with a device per rank."""
        slots = self.compute_slots_per_node()
        if slots is None:
            return None
        work = stage_work(self, layout)
        m = self.training.global_batch_size // layout.micro_batch_size
        return shared_one_f_one_b_s(work, m, slots * self.cluster.num_nodes)


def stage_work(cm: CostModel, layout: PlanLayout) -> StageWork:
    """Per-stage compute and exposed communication of one micro-batch, as `evaluate` sums them
    (layers, half the layer-switch costs, vocabulary work, exposed side-stream vocabulary
    communication), split into compute and communication; plus the gradient tail.

    With ranks sharing compute (`compute_slots_per_node`), a stage's communication is cut by
    what its other tensor-parallel groups compute meanwhile (`hidden_comm_s`)."""
    sums = stage_sums(cm, layout)
    arr, ex = sums.arr, sums.extras
    f, b = arr["f"], arr["b"]
    share_f = f / np.maximum(f + b, 1e-30)  # communication split between passes by duration
    comm_f, comm_b = arr["comm"] * share_f, arr["comm"] * (1.0 - share_f)
    compute_f, compute_b = f - comm_f, b - comm_b
    width = cm.cluster.num_gpus // layout.pp
    slots = cm.compute_slots_per_node() if isinstance(cm, ProfiledCostModel) else None
    overlap = {"overlap_grad_reduce": cm.training.overlap_grad_reduce,
               "overlap_param_gather": cm.training.overlap_param_gather}
    tail = gradient_tail_s(f, b, arr["sync"], arr["gather"], 0.0, cm.overlap_slowdown,
                           **overlap)
    if slots is not None:
        tp, total = _stage_tp(layout), slots * cm.cluster.num_nodes
        hidden_f = np.minimum(comm_f, hidden_comm_s(compute_f, width, tp, total))
        hidden_b = np.minimum(comm_b, hidden_comm_s(compute_b, width, tp, total))
        comm_f, comm_b = comm_f - hidden_f, comm_b - hidden_b
        # Transfers that run beside compute still take their CPU share of the cores: the other
        # groups' hidden collectives, and the data-parallel reduction overlapped with backward.
        per_rank = getattr(cm.comm, "comm_cpu_share", 0.0) * slots / cm.cluster.gpus_per_node
        hidden_tail = arr["sync"] + arr["gather"] - tail
        compute_f = compute_f + per_rank * hidden_f
        compute_b = compute_b + per_rank * (hidden_b + hidden_tail / sums.num_microbatches)
    return StageWork(forward_compute_s=compute_f, forward_comm_s=comm_f,
                     backward_compute_s=compute_b, backward_comm_s=comm_b, p2p_s=ex.p2p_s,
                     tail_comm_s=tail, optimizer_s=arr["opt"], width=width)


def hidden_comm_s(compute_s: np.ndarray, width: int, tp: np.ndarray, slots: float
                  ) -> np.ndarray:
    """Communication of a stage that its other tensor-parallel groups' compute hides when its
    `width` ranks share `slots` compute slots (arrays per stage: compute seconds of a rank
    alone, tensor-parallel size).

    A stage of G = width / tp independent groups, each alternating compute c and a collective
    d layer by layer: its ranks need width * c core-seconds, so an op lasts at least
    c * width / slots; one group's own path is c at its own share, max(1, tp / slots), plus d.
    The groups drift apart, so while one waits in a collective its cores run the others:
    op = max(c * width / slots, c * max(1, tp / slots) + d), i.e. d is hidden up to
    c * (width / slots - max(1, tp / slots)). With one group (tp = width) nothing is hidden:
    while it waits in a collective no other rank has compute to run (measured on 4 ranks over
    2 cores: tp2 x dp2 ran its collectives inside the other group's compute, tp4 left the cores
    idle 27% of the step; tools/bench_costmodel.py --pieces, docs/benchmarks.md)."""
    if slots >= width:
        return np.zeros_like(compute_s)
    own = np.maximum(1.0, tp / slots)
    return np.where(tp < width, compute_s * np.maximum(0.0, width / slots - own), 0.0)


def _stage_tp(layout: PlanLayout) -> np.ndarray:
    """Largest tensor-parallel size of each stage's layers (its vocabulary layers included on
    the first and last stage), the stage's widest lockstep group."""
    out = []
    for k in range(layout.pp):
        chunks = [layout.stages[k + j * layout.pp] for j in range(layout.virtual_stages)]
        tps = [s.tp for a, z in chunks for s in layout.layers[a:z]] or [1]
        if k in (0, layout.pp - 1):
            tps.append(layout.vocab.tp)
        out.append(max(tps))
    return np.array(out, dtype=float)


def predict_iteration_s(cm: CostModel, layout: PlanLayout) -> float:
    """Predicted seconds per optimizer step of a layout (shared compute included; the shared
    simulation plays 1F1B, so interleaved layouts keep the closed form)."""
    ev = evaluate(cm, layout)
    if isinstance(cm, ProfiledCostModel) and layout.virtual_stages == 1:
        shared = cm.shared_iteration_s(layout)
        if shared is not None:
            return shared
    return ev.iteration_s
