"""FlexSP cost model (FlexSP, ASPLOS'25, §4.1.2 Eqs. 11-14), derived from ModelSpec/ClusterSpec.

One Ulysses group of degree d running sequences S (lengths s, tokens S1 = sum s, S2 = sum s^2)
in one micro-batch takes

    time_d(S) = (attn_s_per_token_sq * S2 + linear_s_per_token * S1) / d     (Eq. 12, compute)
              + a2a_s_per_token(d) * S1                                       (Eq. 13, all-to-all)
              + a2a_latency_s(d)                                              (alpha term, d > 1)

and every micro-batch adds `fixed_s_per_microbatch` (beta_1: exposed ZeRO-3 traffic) once: the
micro-batch takes fixed_s + max over groups of time_d. Memory per device (Eq. 11) is
`model_state_bytes + ceil(S1 / d) * act_bytes_per_token`, so a device holds at most
`capacity_tokens` tokens. The planner never imports torch; everything here is float math.

Derivation from specs (all per token, forward + backward, all layers; documented assumptions):
- linear FLOPs: 3 x forward (2 FLOPs per MAC) of qkv, out-proj, MLP and logits;
- attention FLOPs: causal, forward 2 * s^2 * q_dim per layer (QK^T and AV halved by the mask),
  backward 2.5 x forward (flash-attention recomputes S), i.e. 3.5 x forward in total;
- time = FLOPs / (peak_flops * efficiency), efficiencies `linear_mfu` and `attention_mfu`;
- all-to-all: q, k, v and the output, forward and backward, bf16; GQA kv heads travel unduplicated
  while d <= num_query_groups and are replicated to d heads beyond (runtime/flexsp/ulysses.py);
  its speed is one algorithmic bandwidth per degree (`a2a_bytes_per_s`: one rank's send buffer,
  i.e. its s/d tokens, per second), as FlexSP's profiled table bw[d] (see `a2a_bandwidths`);
- activations: bf16 tensors saved for backward with flash attention and no recompute
  (norm/qkv/proj/fc inputs, q, k, v, fc1 output, activation output) plus fp32+bf16 logits;
- model states: ZeRO-3 over all devices, 16 bytes/param (bf16 param+grad, fp32 master+Adam);
- beta_1: ZeRO-3 all-gather (forward, backward) and reduce-scatter of bf16 params over the
  network, of which `zero3_overlap` is hidden behind compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_ext.errors import PlanError
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.cost import compute as C
from megatron_ext.specs import ClusterSpec, ModelSpec

if TYPE_CHECKING:
    from megatron_ext.planner.profile.profiles import ClusterProfile

A2A_PER_LAYER = 8
"""All-to-alls per layer and micro-batch: q, k, v, output; forward and backward."""
BF16_BYTES = 2
ATTN_FWD_BWD_FACTOR = 3.5
"""Attention forward + backward FLOPs over forward FLOPs (flash-attention backward is 2.5x)."""
FLEXSP_A100_A2A_GBPS = {2: 119.5, 4: 104.1, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}
"""FlexSP's profiled all-to-all bandwidth per group degree (PKU-DAIR/Hetu-Galvatron, branch
flexsp, galvatron/flexsp_solver: one rank's buffer / time) on 8 nodes x 8 A100-40GB with
400 Gb/s InfiniBand per node (6.25 GB/s per GPU). Against that per-GPU share, the spanning
groups' inter-node traffic ((d - 8)/d of the buffer) runs at 0.83, 0.71 and 0.68 of line rate
for 2, 4 and 8 nodes: ClusterSpec.all_to_all_inter_efficiency's default."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FlexSPCostModel:
    """Alpha-beta cost and memory model of one FlexSP step on a homogeneous cluster."""

    num_gpus: int
    """Devices N the step runs on; groups' degrees sum to it."""
    gpus_per_node: int
    """Devices per node: an aligned group of degree <= gpus_per_node stays on NVLink."""
    attn_s_per_token_sq: float
    """alpha_1: attention seconds per squared token of one sequence on one device."""
    linear_s_per_token: float
    """alpha_2: seconds per token of the non-attention work on one device."""
    fixed_s_per_microbatch: float
    """beta_1: seconds every micro-batch pays once, whatever the groups."""
    a2a_bytes_per_token_qo: float
    """All-to-all bytes per token for q and the output (fwd + bwd, all layers)."""
    a2a_bytes_per_token_per_kv_head: float
    """All-to-all bytes per token per transported kv head (k and v, fwd + bwd, all layers)."""
    num_query_groups: int
    """Key/value heads of the model."""
    num_attention_heads: int
    """Query heads: a Ulysses degree must divide it."""
    num_layers: int
    """Transformer layers (scales the per-collective latency)."""
    intra_bandwidth_bytes_per_s: float
    """NVLink bandwidth per device."""
    inter_bandwidth_bytes_per_s: float
    """Network bandwidth per device."""
    intra_latency_s: float
    """Start-up latency of one intra-node all-to-all."""
    inter_latency_s: float
    """Start-up latency of one all-to-all that leaves the node."""
    act_bytes_per_token: float
    """Activation bytes a device keeps per local token until backward."""
    model_state_bytes: float
    """Per-device bytes independent of the plan (ZeRO-3 shard, gathered layers, workspace)."""
    memory_budget_bytes: float
    """Usable bytes per device."""
    min_degree: int = 1
    """Smallest group degree the planner may use (power of two)."""
    max_degree: int = 0
    """Largest group degree (power of two); 0 means the largest one the head count allows."""
    a2a_bytes_per_s: tuple[tuple[int, float], ...] = ()
    """(degree, algorithmic bandwidth) pairs: one rank's all-to-all send buffer bytes per second
    in a group of that degree. Degrees not listed use the two-link formula (`_link_a2a_s`)."""

    def __post_init__(self) -> None:
        for name in ("num_gpus", "gpus_per_node", "num_attention_heads", "num_query_groups"):
            if getattr(self, name) < 1:
                raise PlanError(f"flexsp cost {name}={getattr(self, name)} must be >= 1")
        for name in ("min_degree", "max_degree"):
            value = getattr(self, name)
            if value and value & (value - 1):
                raise PlanError(f"flexsp {name}={value} must be a power of two")
        if self.min_degree < 1 or self.effective_max_degree < self.min_degree:
            raise PlanError(
                f"flexsp degrees min={self.min_degree} max={self.effective_max_degree} are empty "
                f"for {self.num_gpus} GPUs and {self.num_attention_heads} heads; lower min_degree"
            )
        if self.capacity_tokens < 1:
            raise PlanError(
                f"flexsp memory_budget_bytes={self.memory_budget_bytes:.3g} leaves no room for "
                f"activations after model_state_bytes={self.model_state_bytes:.3g}; add memory"
            )

    @property
    def effective_max_degree(self) -> int:
        """Largest power of two <= max_degree (or N) that divides the head count and N's range."""
        limit = self.max_degree or self.num_gpus
        d = 1
        while d * 2 <= min(limit, self.num_gpus) and self.num_attention_heads % (d * 2) == 0:
            d *= 2
        return d

    @property
    def degrees(self) -> tuple[int, ...]:
        """Candidate group degrees, ascending powers of two."""
        out, d = [], self.min_degree
        while d <= self.effective_max_degree:
            out.append(d)
            d *= 2
        return tuple(out)

    @property
    def capacity_tokens(self) -> int:
        """Most tokens one device can hold (Eq. 11 solved for the token count)."""
        return int((self.memory_budget_bytes - self.model_state_bytes) // self.act_bytes_per_token)

    def min_degree_for(self, length: int) -> int:
        """Smallest candidate degree whose devices hold a `length`-token sequence (minSP)."""
        need = max(1, math.ceil(length / self.capacity_tokens))
        for d in self.degrees:
            if d >= need:
                return d
        raise PlanError(
            f"sequence length {length} needs {need} devices of {self.capacity_tokens} tokens but "
            f"the largest group is {self.effective_max_degree}; drop or truncate it, or add memory"
        )

    def a2a_bytes_per_token(self, degree: int) -> float:
        """Bytes per sequence token the group's all-to-alls carry (before the (d-1)/d share)."""
        kv_heads = max(self.num_query_groups, degree)
        return self.a2a_bytes_per_token_qo + kv_heads * self.a2a_bytes_per_token_per_kv_head

    def spans_nodes(self, degree: int) -> bool:
        """An aligned group of this degree leaves its node."""
        return degree > self.gpus_per_node or self.gpus_per_node % degree != 0

    def a2a_s_per_token(self, degree: int) -> float:
        """Seconds of all-to-all per sequence token in a group of `degree` (Eq. 13 without beta)."""
        if degree == 1:
            return 0.0
        per_device = self.a2a_bytes_per_token(degree) / degree  # each device holds s/d tokens
        for d, bytes_per_s in self.a2a_bytes_per_s:
            if d == degree:
                return per_device / bytes_per_s
        return self._link_a2a_s(degree, per_device)

    def _link_a2a_s(self, degree: int, per_device: float) -> float:
        """Each rank sends (d-1)/d of its buffer: intra-node peers over NVLink, the rest over the
        network, concurrently, so the slower share sets the time (the intra/inter-node cliff)."""
        if not self.spans_nodes(degree):
            intra_peers, inter_peers = degree - 1, 0
        elif self.gpus_per_node % degree == 0 or degree % self.gpus_per_node == 0:
            intra_peers = self.gpus_per_node - 1  # whole nodes
            inter_peers = degree - self.gpus_per_node
        else:  # a node size that is not a power of two: count every peer as remote
            intra_peers, inter_peers = 0, degree - 1
        return max(per_device * intra_peers / degree / self.intra_bandwidth_bytes_per_s,
                   per_device * inter_peers / degree / self.inter_bandwidth_bytes_per_s)

    def a2a_latency_s(self, degree: int) -> float:
        """Start-up latency of a group's all-to-alls in one micro-batch."""
        if degree == 1:
            return 0.0
        latency = self.inter_latency_s if self.spans_nodes(degree) else self.intra_latency_s
        return A2A_PER_LAYER * self.num_layers * latency

    def seq_time_s(self, length: float, length_sq: float, degree: int) -> float:
        """time_d of sequences with sum `length` and sum of squares `length_sq`, no latency."""
        compute = (self.attn_s_per_token_sq * length_sq + self.linear_s_per_token * length) / degree
        return compute + self.a2a_s_per_token(degree) * length

    def group_time_s(self, lengths: list[int] | tuple[int, ...], degree: int) -> float:
        """Time of one group running `lengths` in one micro-batch (0 when empty), without beta."""
        if not lengths:
            return 0.0
        s1 = float(sum(lengths))
        s2 = float(sum(x * x for x in lengths))
        return self.seq_time_s(s1, s2, degree) + self.a2a_latency_s(degree)


def linear_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs per token of every matmul except attention's score/value products (the
    layer GEMMs of planner/cost/compute.py plus the output layer)."""
    per_layer = float(C.layer_gemm_forward_flops(model, 1.0, 1))
    return model.num_layers * per_layer + 2 * model.hidden_size * model.vocab_size


def num_params(model: ModelSpec) -> float:
    """Parameter count (weights only; norms and biases are negligible here)."""
    embeddings = (1 if model.tied_embeddings else 2) * model.hidden_size * model.vocab_size
    return model.num_layers * C.layer_matmul_params(model) + embeddings


def act_bytes_per_token(model: ModelSpec) -> float:
    """bf16 activations saved for backward per token (flash attention, no recompute) + logits."""
    h, ffn = model.hidden_size, model.ffn_hidden_size
    q_dim = model.num_attention_heads * model.head_dim
    kv_dim = model.num_query_groups * model.head_dim
    mlp_saved = (3 if model.activation == "swiglu" else 2) * ffn  # fc1 out (+gate) and act out
    # norm1 in, qkv in, norm2 in, fc1 in (4h); q, attention out (2 q_dim); k, v (2 kv_dim)
    per_layer = BF16_BYTES * (4 * h + 2 * q_dim + 2 * kv_dim + mlp_saved)
    logits = (BF16_BYTES + 4) * model.vocab_size  # bf16 logits + fp32 softmax for the loss
    return model.num_layers * per_layer + logits


def cost_model_from_specs(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    num_gpus: int | None = None,
    linear_mfu: float = 0.5,
    attention_mfu: float = 0.4,
    zero3_overlap: float = 0.75,
    memory_reserve_fraction: float = 0.1,
    a2a_inter_efficiency: float | None = None,
    profile: ClusterProfile | None = None,
    min_degree: int = 1,
    max_degree: int = 0,
) -> FlexSPCostModel:
    """Derive the FlexSP constants for `model` on `cluster` (see the module docstring).

    `linear_mfu`/`attention_mfu`: achieved fraction of peak for matmuls and flash attention;
    `zero3_overlap`: fraction of the per-micro-batch ZeRO-3 traffic hidden behind compute;
    `memory_reserve_fraction`: device memory kept free for the allocator, NCCL and workspaces;
    `a2a_inter_efficiency`: one share of inter-node bandwidth for every node-spanning
    all-to-all, overriding `cluster.all_to_all_inter_efficiency` (sensitivity studies);
    `profile`: measured all-to-all curves (`megatron-ext profile hardware`) win over the
    cluster's links for the group sizes they cover (see `a2a_bandwidths`).
    Calibrate them by profiling; the defaults are typical H100/A100 bf16 values.
    """
    for name, value in (("linear_mfu", linear_mfu), ("attention_mfu", attention_mfu)):
        if not 0 < value <= 1:
            raise PlanError(f"{name}={value} must be in (0, 1]")
    if a2a_inter_efficiency is not None and not 0 < a2a_inter_efficiency <= 1:
        raise PlanError(f"a2a_inter_efficiency={a2a_inter_efficiency} must be in (0, 1]")
    if not 0 <= zero3_overlap <= 1 or not 0 <= memory_reserve_fraction < 1:
        raise PlanError(
            f"zero3_overlap={zero3_overlap} must be in [0, 1] and "
            f"memory_reserve_fraction={memory_reserve_fraction} in [0, 1)"
        )
    n = num_gpus or cluster.num_gpus
    if n < 1:
        raise PlanError(f"--gpus={n} must be >= 1")
    q_dim = model.num_attention_heads * model.head_dim
    linear_s = 3 * linear_flops_per_token(model) / (cluster.peak_flops * linear_mfu)
    # causal attention forward FLOPs per token^2 (planner/cost/compute.py, flash attention)
    attn_fwd_flops_per_token_sq = (model.num_layers
                                   * float(C.attention_forward_flops(model, 1, 1, 1)))
    attn_s = (ATTN_FWD_BWD_FACTOR * attn_fwd_flops_per_token_sq
              / (cluster.peak_flops * attention_mfu))
    a2a_per_tensor = 2 * model.num_layers * BF16_BYTES  # fwd + bwd, every layer
    params = num_params(model)
    layer_params = params / model.num_layers
    zero3_bytes = 3 * params * BF16_BYTES * (n - 1) / n  # gather fwd, gather bwd, reduce-scatter
    zero3_link = cluster.inter_node if n > cluster.gpus_per_node else cluster.intra_node
    zero3_s = zero3_bytes / zero3_link.bandwidth_bytes_per_s
    # ZeRO-3 shard + two gathered bf16 layers (current and prefetched) + their bf16 grads
    model_state = 16 * params / n + 4 * layer_params * BF16_BYTES
    return FlexSPCostModel(
        num_gpus=n,
        gpus_per_node=min(cluster.gpus_per_node, n),
        attn_s_per_token_sq=attn_s,
        linear_s_per_token=linear_s,
        fixed_s_per_microbatch=(1 - zero3_overlap) * zero3_s,
        a2a_bytes_per_token_qo=a2a_per_tensor * 2 * q_dim,
        a2a_bytes_per_token_per_kv_head=a2a_per_tensor * 2 * model.head_dim,
        num_query_groups=model.num_query_groups,
        num_attention_heads=model.num_attention_heads,
        num_layers=model.num_layers,
        intra_bandwidth_bytes_per_s=cluster.intra_node.bandwidth_bytes_per_s,
        inter_bandwidth_bytes_per_s=cluster.inter_node.bandwidth_bytes_per_s,
        intra_latency_s=cluster.intra_node.latency_s,
        inter_latency_s=cluster.inter_node.latency_s,
        act_bytes_per_token=act_bytes_per_token(model),
        model_state_bytes=model_state,
        memory_budget_bytes=cluster.memory_gib * 2**30 * (1 - memory_reserve_fraction),
        min_degree=min_degree,
        max_degree=max_degree,
        a2a_bytes_per_s=a2a_bandwidths(cluster, n, inter_efficiency=a2a_inter_efficiency,
                                       profile=profile),
    )


def paper_gpt7b_a100(num_gpus: int = 64) -> FlexSPCostModel:
    """FlexSP's released constants for GPT-7B (64 heads) on A100-40GB (`optimizer_param_dict`).

    alpha_1 = 5.128e-6 ms/tok^2, alpha_2 = 0.18396 ms/tok, beta_1 = 629.4 ms, 4.48 MB/token,
    28 GB budget, all-to-all 4 tensors x fwd/bwd x 32 layers x h=4096 x bf16, and the profiled
    per-degree bandwidths FLEXSP_A100_A2A_GBPS (the code's MiB/ms "GB/s"). For cross-checking
    against the paper's numbers only.
    """
    h, layers = 4096, 32
    return FlexSPCostModel(
        num_gpus=num_gpus, gpus_per_node=8,
        attn_s_per_token_sq=5.128e-9, linear_s_per_token=0.18396e-3,
        fixed_s_per_microbatch=0.6294,
        a2a_bytes_per_token_qo=2 * layers * BF16_BYTES * 2 * h,
        a2a_bytes_per_token_per_kv_head=2 * layers * BF16_BYTES * 2 * 64,
        num_query_groups=64, num_attention_heads=64, num_layers=layers,
        intra_bandwidth_bytes_per_s=100e9, inter_bandwidth_bytes_per_s=5.5e9,
        intra_latency_s=5e-6, inter_latency_s=1.5e-5,
        act_bytes_per_token=4.48 * 2**20,
        model_state_bytes=6.7e9 * 16 / num_gpus,
        memory_budget_bytes=28 * 2**30,
        a2a_bytes_per_s=tuple((d, bw * 2**20 * 1e3) for d, bw in FLEXSP_A100_A2A_GBPS.items()),
    )


def cost_model_for_plan(plan: ParallelPlan, **kwargs: float) -> FlexSPCostModel:
    """The FlexSP cost model of a plan file with a `flexsp` section (its model, its cluster,
    its world size, and its min/max group sizes); `kwargs` go to cost_model_from_specs."""
    if plan.flexsp is None or plan.cluster is None:
        raise PlanError(
            "the plan needs both a flexsp section and a cluster to plan FlexSP steps; add "
            '"flexsp": {"max_group_size": 8} and the cluster it runs on'
        )
    return cost_model_from_specs(
        plan.model, plan.cluster, num_gpus=plan.world_size,
        min_degree=plan.flexsp.min_group_size, max_degree=plan.flexsp.max_group_size,
        **kwargs)  # type: ignore[arg-type]


def a2a_bandwidths(
    cluster: ClusterSpec, num_gpus: int, *, inter_efficiency: float | None = None,
    profile: ClusterProfile | None = None,
) -> tuple[tuple[int, float], ...]:
    """(degree, algorithmic all-to-all bandwidth) of an aligned group of each power-of-two
    degree 2..num_gpus: one rank's send buffer bytes per second (FlexSP's bw[d] convention).

    Measured where `profile` has an all_to_all curve of that group size with
    min(d, gpus_per_node) ranks per node (the curve's large-message bandwidth). Otherwise the
    topology: each rank sends (d-1)/d of its buffer; an intra-node group's share crosses NVLink at
    `cluster.intra_node` bandwidth; a group of whole nodes sends (gpus_per_node - 1)/d over NVLink
    and (d - gpus_per_node)/d over its GPU's share of the network at `cluster.inter_node`
    bandwidth x the all-to-all efficiency for that many nodes (`all_to_all_inter_efficiency`,
    FlexSP's measured 0.83/0.71/0.68 for 2/4/8 nodes by default: more peers, smaller messages
    and cross-rail traffic than the all-reduce the link figure describes), both concurrently,
    so the slower share sets the time.
    """
    gpn = min(cluster.gpus_per_node, num_gpus)
    table = ((inter_efficiency,) if inter_efficiency is not None
             else cluster.all_to_all_inter_efficiency)
    intra_bw = cluster.intra_node.bandwidth_bytes_per_s
    out, d = [], 2
    while d <= num_gpus:
        curve = profile.curve("all_to_all", d, min(d, gpn)) if profile is not None else None
        if curve is not None:
            out.append((d, curve.fit.bytes_per_s))
            d *= 2
            continue
        nodes = -(-d // gpn)
        eff = table[min(max(0, math.ceil(math.log2(nodes)) - 1), len(table) - 1)]
        inter_bw = cluster.inter_node.bandwidth_bytes_per_s * eff
        if nodes == 1 and gpn % d == 0:  # aligned inside one node
            s_per_byte = (d - 1) / d / intra_bw
        elif d % gpn == 0:  # whole nodes
            s_per_byte = max((gpn - 1) / d / intra_bw, (d - gpn) / d / inter_bw)
        else:  # a node size that is not a power of two: count every peer as remote
            s_per_byte = (d - 1) / d / inter_bw
        out.append((d, 1.0 / s_per_byte))
        d *= 2
    return tuple(out)
