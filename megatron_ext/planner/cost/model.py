"""`CostModel`: time and memory of every layer strategy, layer switch and vocabulary layout.

Built from (ModelSpec, ClusterSpec, TrainingSpec) plus optional measured profiles: a
`CommModel` (collective curves from the hardware profiler) and a `ComputeProfile` (kernel
efficiencies). The search, the uniform baseline, the vocabulary planner and the profiler's
calibration all read costs through this object, so they agree by construction.

Rank order inside a pipeline stage follows Megatron: tp innermost, then cp, ulysses, dp (pp is
outermost). A group's members are therefore `stride` ranks apart: tp 1, cp tp, ulysses tp*cp,
the gradient (dp x cp x ulysses) group tp. Whether a group crosses nodes follows from that.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from megatron_ext.plan_checks import check_fp8_cluster
from megatron_ext.planner.cost import compute as C
from megatron_ext.planner.cost.comm import (
    ZERO3_NICS_PER_GPU,
    AlphaBetaComm,
    ArrayLike,
    Collective,
    CommModel,
    GroupLayout,
    nvlink_group_layout,
    zero3_exposed_s,
)
from megatron_ext.planner.cost.fp8 import fp8_layer_costs
from megatron_ext.planner.cost.memory import (
    layer_activation_bytes,
    layer_transient_bytes,
    state_bytes_per_param,
)
from megatron_ext.planner.cost.pipeline import OVERLAP_SLOWDOWN, gradient_tail_s
from megatron_ext.planner.cost.tp_overlap import overlapped_tp_s, sp_regather_exposed_s
from megatron_ext.planner.dp import MaxSwitch
from megatron_ext.planner.space import StrategyTable
from megatron_ext.planner.training import (
    BF16_OPTIMIZER_ACCUMULATE_BYTES,
    DEEPSPEED_MAX_LIVE_PARAMS,
    TrainingSpec,
)
from megatron_ext.specs import ClusterSpec, ModelSpec

FloatArray = npt.NDArray[np.float64]
"""Values per strategy ([S]; [S, S] for switches). Spelled with a dtype so that the type
checker's no-Any rule for this module holds (a bare np.ndarray has Any parameters)."""
IntArray = npt.NDArray[np.int64]

GRAD_BYTES = 4
"""ZeRO-3 (FSDP) reduce-scatters fp32 gradients; ZeRO 0-1 reduce in
TrainingSpec.grad_reduce_bytes (fp16 runs in fp16)."""


def ddp_bucket_params(d: IntArray | int) -> FloatArray:
    """megatron-core's default gradient bucket: max(4e7, 1e6 x data-parallel size) parameters
    (distributed/distributed_data_parallel.py, --ddp-bucket-size unset)."""
    return np.maximum(4e7, 1e6 * np.asarray(d, dtype=float))


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCosts:
    """Costs of one transformer layer under each of S strategies at one micro-batch size; [S]."""

    forward_s: FloatArray
    """One micro-batch forward: compute + TP/Ulysses comm + exposed CP and ZeRO-3 comm."""
    backward_s: FloatArray
    """One micro-batch backward, including recomputation and its communication."""
    recompute_s: FloatArray
    """The part of backward_s spent recomputing."""
    comm_s: FloatArray
    """The part of forward_s + backward_s spent in exposed communication."""
    grad_sync_s: FloatArray
    """Once per iteration: all-reduce (ZeRO-0) or reduce-scatter (ZeRO-1) of fp32 gradients."""
    param_gather_s: FloatArray
    """Once per iteration: ZeRO-1 all-gather of the updated half-precision weights."""
    optimizer_s: FloatArray
    """Once per iteration: Adam on this GPU's shard."""
    state_bytes: FloatArray
    """Weights + gradients + optimizer states on one GPU."""
    activation_bytes: FloatArray
    """Kept for backward, per in-flight micro-batch."""
    transient_bytes: FloatArray
    """Short-lived while this layer runs backward (recomputed activations, gathered weights)."""

    def objective_s(
        self, num_microbatches: int, overlap_slowdown: float, training: TrainingSpec
    ) -> FloatArray:  # [S]
        """The layerwise DP's per-layer time: one micro-batch's forward + backward, plus this
        layer's share of the once-per-iteration tail (exposed reduction, optimizer, exposed
        all-gather; pipeline.gradient_tail_s with the training's overlap flags) spread over the
        m micro-batches."""
        exposed = gradient_tail_s(
            self.forward_s, self.backward_s, self.grad_sync_s, self.param_gather_s, 0.0,
            overlap_slowdown, overlap_grad_reduce=training.overlap_grad_reduce,
            overlap_param_gather=training.overlap_param_gather)
        return self.forward_s + self.backward_s + (exposed + self.optimizer_s) / num_microbatches

    def memory_bytes(self, inflight: int) -> FloatArray:  # [S]
        return self.state_bytes + inflight * self.activation_bytes


class CostModel:
    """Time and memory of layer strategies, switches and vocabulary layouts (see module doc)."""

    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        training: TrainingSpec,
        *,
        comm: CommModel | None = None,
        compute: C.ComputeProfile | None = None,
    ) -> None:
        self.model = model
        self.cluster = cluster
        self.training = training
        if training.fp8 is not None:
            check_fp8_cluster(training.fp8, cluster)
        self.comm: CommModel = comm if comm is not None else AlphaBetaComm(cluster=cluster)
        self.compute = compute if compute is not None else C.ComputeProfile()
        self.layer_params = C.layer_params(model)
        self.overlap_slowdown = float(getattr(self.comm, "overlap_slowdown", OVERLAP_SLOWDOWN))
        """Slowdown of overlapped communication: measured by a cluster profile, else default."""

    def without_fp8(self) -> CostModel:
        """The same cost model with every layer in bf16 (the layers an FP8 run keeps in bf16)."""
        other = copy.copy(self)
        other.training = dataclasses.replace(self.training, fp8=None)
        return other

    def with_training(self, training: TrainingSpec) -> CostModel:
        """The same cost model with other training settings (profiles and cluster kept)."""
        other = copy.copy(self)
        other.training = training
        return other

    def with_cluster(self, cluster: ClusterSpec) -> CostModel:
        """The same cost model on another cluster (more nodes, other memory); measured
        profiles are kept, the alpha-beta formula follows the new cluster."""
        other = copy.copy(self)
        other.cluster = cluster
        if isinstance(self.comm, AlphaBetaComm):
            other.comm = AlphaBetaComm(cluster=cluster)
        return other

    # ---- small helpers --------------------------------------------------------------------

    @property
    def zero3_live_params(self) -> float | None:
        """Most parameters ZeRO-3 holds gathered at once; None: two whole layers (FSDP2 and
        Megatron-FSDP gather layer by layer). DeepSpeed's engine caps it
        (stage3_max_live_parameters, training.DEEPSPEED_MAX_LIVE_PARAMS by default)."""
        return DEEPSPEED_MAX_LIVE_PARAMS if self.training.is_deepspeed else None

    @property
    def element_bytes(self) -> int:
        return self.training.activation_bytes

    @property
    def memory_cap_bytes(self) -> float:
        """Usable memory per GPU minus the fixed reserve."""
        return self.cluster.memory_gib * 2**30 - self.training.reserve_bytes(
            self.cluster.memory_gib
        )

    def layout(self, size: int, stride: int) -> GroupLayout:
        return nvlink_group_layout(int(size), int(stride), self.cluster)

    def collective_s(
        self,
        collective: Collective,
        num_bytes: ArrayLike,
        sizes: ArrayLike,
        strides: ArrayLike,
        nics_per_gpu: float | None = None,
    ) -> FloatArray:
        """Vectorised over strategies: one call per distinct (size, stride) group.
        `nics_per_gpu` caps how many members per node drive their NICs in parallel when the
        group crosses nodes (None: all of them; ZeRO-3 passes ZERO3_NICS_PER_GPU)."""
        sizes = np.broadcast_to(sizes, np.shape(num_bytes))
        strides = np.broadcast_to(strides, np.shape(num_bytes))
        out = np.zeros(np.shape(num_bytes))
        for size, stride in set(zip(sizes.tolist(), strides.tolist())):
            if size == 1:
                continue
            sel = (sizes == size) & (strides == stride)
            layout = self.layout(size, stride)
            if nics_per_gpu is not None and layout.crosses_nodes:
                layout = GroupLayout(size=layout.size, ranks_per_node=layout.ranks_per_node,
                                     nics_in_parallel=nics_per_gpu)
            out[sel] = self.comm.time_s(collective, np.asarray(num_bytes)[sel], layout)
        return out

    def p2p_s(self, pp: int, micro_batch_size: int) -> float:
        """One activation message between neighbouring stages: each of the W ranks sends its
        1/W share of [s, B, h] (Megatron's scatter-gather p2p), W ranks apart."""
        if pp == 1:
            return 0.0
        width = self.cluster.num_gpus // pp
        num_bytes: float = micro_batch_size * self.training.seq_length * self.model.hidden_size
        num_bytes *= self.element_bytes / width
        return float(
            self.comm.time_s("p2p", num_bytes, nvlink_group_layout(2, width, self.cluster))
        )

    # ---- transformer layers ---------------------------------------------------------------

    def layer_costs(self, table: StrategyTable, micro_batch_size: int) -> LayerCosts:
        """Costs of one layer under every strategy of `table`, at micro_batch_size samples per
        micro-batch summed over the stage's replicas."""
        m, t = self.model, self.training
        e = self.element_bytes
        b = micro_batch_size / table.dp
        shards = table.cp * table.ulysses
        rows = b * t.seq_length / shards  # tokens per rank in the linear layers
        fused = self.fused_softmax(table, b)
        comp = C.layer_compute(
            m,
            self.cluster,
            self.compute,
            b=b,
            seq_length=t.seq_length,
            tp=table.tp,
            sp=table.sp,
            seq_shards=shards,
            element_bytes=e,
            flash_attention=t.flash_attention,
            fused_softmax=fused,
        )
        # TP: 2 all-reduces (or all-gather + reduce-scatter under SP) of [rows, h] each way,
        # each collective at its own curve (gloo's reduce-scatter costs ~2.5x its all-gather).
        hidden_bytes = rows * m.hidden_size * e
        tp_ar = self.collective_s("all_reduce", hidden_bytes, table.tp, 1)
        tp_ag = self.collective_s("all_gather", hidden_bytes, table.tp, 1)
        tp_rs = self.collective_s("reduce_scatter", hidden_bytes, table.tp, 1)
        tp_sp = tp_ag + tp_rs
        tp_one_way = 2 * np.where(table.sp, tp_sp, tp_ar)  # attention block + MLP block
        tp_fwd = tp_one_way  # forward (and recomputed forward)
        regather = sp_regather_exposed_s(self, table, rows, tp_ag)  # SP backward, beside dgrad
        tp_bwd = tp_one_way + np.where(table.sp, regather, 0.0)
        if t.tp_comm_overlap:  # TE userbuffers hide most of the SP collectives (tp_overlap.py)
            over_f, over_b = overlapped_tp_s(self, table, rows, tp_ag)
            tp_fwd = np.where(table.sp, over_f, tp_one_way)
            tp_bwd = np.where(table.sp, over_b, tp_one_way)
        # Ulysses: all-to-all of q, k, v before attention and of its output after, each way.
        uly_bytes = rows * (2 * C.q_dim(m) + 2 * C.kv_dim(m)) / table.tp * e
        uly_one_way = self.collective_s("all_to_all", uly_bytes, table.ulysses, table.tp * table.cp)
        cp_fwd, cp_bwd = self._cp_exposed_s(table, rows, comp)
        rc_full = table.recompute == 2
        # Each pass (forward, recomputed forward, backward) takes at least the host time to
        # issue its kernels (compute.host_bound_s): small layers and micro-batches are
        # host-bound.
        host_f, host_b, host_attn = C.layer_host_s(
            m, self.compute.host_for(self.cluster), tp=table.tp,
            flash_attention=t.flash_attention, dropout=t.dropout, fused_softmax=fused,
            forward_kernels=self.compute.layer_forward_kernels,
            backward_kernels=self.compute.layer_backward_kernels)
        k = self.compute.host_overlap_power
        recompute = np.where(
            rc_full,
            C.host_bound_s(comp.forward_s + tp_fwd + uly_one_way + cp_fwd, host_f, k),
            0.0)
        recompute = recompute + np.where(
            table.recompute == 1, C.host_bound_s(comp.attention_forward_s, host_attn, k), 0.0)
        z3_fwd, z3_bwd, sync, gather = self._data_parallel_s(
            table, comp.forward_s, comp.backward_s + recompute
        )
        fwd = C.host_bound_s(comp.forward_s + tp_fwd + uly_one_way + cp_fwd + z3_fwd,
                             host_f, k)
        accumulate = self.grad_accumulate_s(self._params_per_gpu(table))
        bwd = C.host_bound_s(comp.backward_s + tp_bwd + uly_one_way + cp_bwd + z3_bwd
                             + accumulate, host_b, k) + recompute
        # (a + u) + (a + u) is 2 (a + u) bit for bit: without the overlap nothing moves
        comm = (tp_fwd + uly_one_way) + (tp_bwd + uly_one_way) + cp_fwd + cp_bwd + z3_fwd + z3_bwd
        comm = comm + np.where(rc_full, tp_fwd + uly_one_way + cp_fwd, 0.0)
        costs = LayerCosts(
            forward_s=np.asarray(fwd),
            backward_s=np.asarray(bwd),
            recompute_s=recompute,
            comm_s=comm,
            grad_sync_s=sync,
            param_gather_s=gather,
            optimizer_s=np.asarray(C.optimizer_step_s(
                self._params_per_gpu(table) / np.where(table.zero >= 1, table.shard_ranks, 1),
                self.cluster,
                self.compute,
            )),
            **self._layer_memory(table, b),
        )
        return fp8_layer_costs(self, table, b, costs) if self.training.fp8 else costs

    def grad_accumulate_s(self, params: ArrayLike) -> ArrayLike:
        """GPU seconds per micro-batch an engine spends folding `params` gradients into its own
        copy after the backward: DeepSpeed's BF16_Optimizer (BF16_OPTIMIZER_ACCUMULATE_BYTES
        through HBM per parameter); 0 for the others, whose backward writes the gradients in
        place (Megatron's main_grad, FSDP2's reduce-scatter)."""
        if self.training.engine != "deepspeed-bf16":
            return 0.0 * np.asarray(params, dtype=float)
        return BF16_OPTIMIZER_ACCUMULATE_BYTES * np.asarray(params, dtype=float) / (
            self.compute.hbm_for(self.cluster))

    def fused_softmax(self, table: StrategyTable, b: FloatArray | float) -> npt.NDArray[np.bool_]:
        """Where the unfused attention path gets Megatron's fused softmax kernel (per strategy,
        at b samples per replica; compute.fused_softmax_available)."""
        return C.fused_softmax_available(
            self.model, b=b, seq_length=self.training.seq_length,
            heads_shards=table.tp * table.ulysses, element_bytes=self.element_bytes)

    def _params_per_gpu(self, table: StrategyTable) -> FloatArray:
        return self.layer_params / table.tp

    def bucketed_s(self, collective: Collective, params: ArrayLike, bytes_per_param: float,
                   d: IntArray, stride: IntArray) -> FloatArray:
        """A layer's share of Megatron's bucketed data-parallel collectives: its params x
        bytes_per_param priced at the rate of one bucket of max(params, DDP_BUCKET_PARAMS(d))
        parameters (megatron-core DistributedDataParallel: buckets of max(4e7, 1e6 d)
        parameters with --overlap-grad-reduce; without it one bucket per gradient buffer, at
        least that large), so NCCL's latency is paid per bucket, not per layer."""
        params = np.asarray(params, dtype=float)
        bucket = np.maximum(params, ddp_bucket_params(d)) * bytes_per_param
        per_bucket = self.collective_s(collective, bucket, d, stride)
        return per_bucket * params * bytes_per_param / np.maximum(bucket, 1.0)

    def _cp_exposed_s(
        self, table: StrategyTable, rows: FloatArray, comp: C.LayerCompute
    ) -> tuple[FloatArray, FloatArray]:
        """Ring attention: cp-1 steps each passing this rank's K and V chunk [rows, 2kv/t]
        (forward) and K, V plus their gradients (backward), hidden behind attention compute."""
        kv = C.kv_dim(self.model) if self.model.mla is None else C.attention_dim(self.model)
        kv_bytes = 2 * rows * kv / table.tp * self.element_bytes
        step = np.zeros_like(kv_bytes)
        for cp, tp in set(zip(table.cp.tolist(), table.tp.tolist())):
            if cp == 1:
                continue
            sel = (table.cp == cp) & (table.tp == tp)
            layout = self.layout(cp, tp)
            step[sel] = self.comm.time_s(
                "p2p",
                kv_bytes[sel],
                GroupLayout(size=2, ranks_per_node=1 if layout.crosses_nodes else 2),
            )
        fwd_comm = (table.cp - 1) * step
        fwd = np.maximum(0.0, fwd_comm - comp.attention_forward_s)
        bwd = np.maximum(0.0, 2 * fwd_comm - 2.5 * comp.attention_forward_s)
        return fwd, bwd

    def _data_parallel_s(
        self, table: StrategyTable, forward_s: ArrayLike, backward_s: ArrayLike,
        *, params: ArrayLike | None = None, shard_ranks: IntArray | None = None,
        stride: IntArray | None = None,
    ) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
        """Gradient reduction, ZeRO-1 weight all-gather and ZeRO-2/3 per-micro-batch traffic over
        the d = dp*cp*ulysses ranks sharing a shard (stride tp). `forward_s` / `backward_s`:
        the layer's compute that ZeRO-3 traffic can hide behind (backward incl. recompute).
        `params`, `shard_ranks`, `stride` replace the layer's parameters per GPU, d and the
        group's stride (cost/moe.py prices expert parameters over the expert-DP group)."""
        params = self._params_per_gpu(table) if params is None else params
        d = table.shard_ranks if shard_ranks is None else shard_ranks
        stride = table.tp if stride is None else stride
        zero = table.zero
        grad_bytes = self.training.grad_reduce_bytes
        zero1_op, zero1_bytes = self.training.zero1_grad_reduce
        grads = self.bucketed_s(zero1_op, params, zero1_bytes, d, stride)
        weights = self.bucketed_s("all_gather", params, self.element_bytes, d, stride)
        all_reduce = self.bucketed_s("all_reduce", params, grad_bytes, d, stride)
        sync = np.where(zero == 0, all_reduce, np.where(zero == 1, grads, 0.0))
        gather = np.where(zero == 1, weights, 0.0)
        # ZeRO-3 gathers weights before forward and again before backward (the recompute
        # forward and the backward share that gather) and reduce-scatters fp32 gradients every
        # micro-batch; prefetching hides it behind the layer's own compute. Across nodes these
        # per-layer collectives run at ZERO3_NICS_PER_GPU NICs per GPU (comm.py). ZeRO-2 (FSDP2
        # without the re-shard after forward) keeps the forward's gather for the backward.
        z3 = zero == 3
        z3_ag = self.collective_s("all_gather", params * self.element_bytes, d, stride,
                                  nics_per_gpu=ZERO3_NICS_PER_GPU)
        z3_rs = self.collective_s("reduce_scatter", params * GRAD_BYTES, d, stride,
                                  nics_per_gpu=ZERO3_NICS_PER_GPU)
        fsdp = zero >= 2
        z3_fwd = np.where(fsdp, zero3_exposed_s(z3_ag, forward_s), 0.0)
        z3_bwd = np.where(fsdp, zero3_exposed_s(np.where(z3, z3_ag, 0.0) + z3_rs, backward_s),
                          0.0)
        return z3_fwd, z3_bwd, sync, gather

    def _layer_memory(self, table: StrategyTable, b: FloatArray) -> dict[str, FloatArray]:
        t = self.training

        def activation(recompute: IntArray) -> ArrayLike:
            return layer_activation_bytes(
                self.model, b=b, seq_length=t.seq_length, tp=table.tp, sp=table.sp,
                cp=table.cp, ulysses=table.ulysses, recompute=recompute,
                element_bytes=self.element_bytes, flash_attention=t.flash_attention,
                dropout=t.dropout)

        act = activation(table.recompute)
        act_none = activation(np.zeros_like(table.recompute))
        params = self._params_per_gpu(table)
        per_param = state_bytes_per_param(
            table.zero,
            table.shard_ranks,
            half_precision=t.half_precision,
            num_optimizer_states=t.num_optimizer_states,
            half_grads=t.keeps_half_grads,
        )
        transient = layer_transient_bytes(
            act_none,
            act,
            zero=table.zero,
            params_per_gpu=params,
            element_bytes=self.element_bytes,
            zero3_live_params=self.zero3_live_params,
        )
        return {
            "state_bytes": params * per_param,
            "activation_bytes": np.asarray(act, dtype=float),
            "transient_bytes": np.asarray(transient, dtype=float),
        }

    def transition_model(self, table: StrategyTable, micro_batch_size: int) -> MaxSwitch:
        """Seconds per micro-batch (forward activation + backward gradient) to move the hidden
        state between consecutive layers whose layouts differ, in the DP's "max" form over the
        table's layout ids. Generic re-layout: an all-to-all over the stage's W ranks of the
        larger per-rank shard, each way, so the cost is that of the larger shard's level. Only SP
        toggled (same tp, cp, ulysses, dp): one all-gather over the tp group (the other
        direction is a local slice), or the generic move if that is cheaper."""
        m, t = self.model, self.training
        first = np.unique(table.layout, return_index=True)[1]  # one strategy per layout id
        tp, sp, cp = table.tp[first], table.sp[first], table.cp[first]
        uly, dp = table.ulysses[first], table.dp[first]
        width = int(tp[0] * cp[0] * uly[0] * dp[0]) if len(first) else 1  # ranks per stage
        full = micro_batch_size * t.seq_length * m.hidden_size * self.element_bytes
        shard = full / (dp * cp * uly * np.where(sp, tp, 1))  # [G] bytes per rank
        sizes, level = np.unique(shard, return_inverse=True)
        level_cost = 2 * np.asarray(
            self.comm.time_s("all_to_all", sizes, self.layout(width, 1)), dtype=float
        )
        level_cost = np.maximum.accumulate(level_cost)  # a measured curve may wiggle
        gather = self.collective_s("all_gather", full / (dp * cp * uly), tp, 1)
        exceptions = []
        for a in range(len(first)):
            for b in range(len(first)):
                same = tp[a] == tp[b] and cp[a] == cp[b] and uly[a] == uly[b] and dp[a] == dp[b]
                if a != b and same:
                    rule = level_cost[max(level[a], level[b])]
                    exceptions.append((a, b, float(min(gather[a], rule))))
        return MaxSwitch(level=level, level_cost_s=level_cost, exceptions=tuple(exceptions))

    def transition_s(self, table: StrategyTable, micro_batch_size: int) -> FloatArray:  # [S, S]
        """The switch costs of `transition_model` for every pair of strategies."""
        if len(table) == 0:
            return np.zeros((0, 0))
        return self.transition_model(table, micro_batch_size).matrix()[
            np.ix_(table.layout, table.layout)
        ]
