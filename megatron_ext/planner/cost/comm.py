"""Communication cost: collectives under an alpha-beta model that knows when a group crosses nodes.

Legend: p = group size, q = group members inside one node, n = p / q nodes spanned,
N = bytes (all_reduce / broadcast: the buffer; all_gather: the gathered output; reduce_scatter:
the full input; all_to_all: one rank's send buffer; p2p: the message).

Every cost goes through one interface, `CommModel.time_s(collective, num_bytes, layout)`, so the
hardware profiler's measured curves (megatron_ext.planner.profile.profiles.ClusterProfile
implements it) replace
the formulas without touching the rest of the cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from megatron_ext.specs import ClusterSpec

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p"]
COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "p2p",
)
ArrayLike = float | np.ndarray


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupLayout:
    """Where the members of one process group sit: p ranks, q of them per node."""

    size: int
    """Ranks in the group (p)."""
    ranks_per_node: int
    """Members inside one node (q); size // ranks_per_node nodes are spanned."""
    nics_in_parallel: float | None = None
    """How many of the q members' NICs carry one collective at once when it crosses nodes;
    None means all q (NCCL's rings, one per NIC). ZeRO-3 sets ZERO3_NICS_PER_GPU."""

    @property
    def num_nodes(self) -> int:
        return max(1, self.size // self.ranks_per_node)

    @property
    def crosses_nodes(self) -> bool:
        return self.num_nodes > 1


def group_layout(size: int, stride: int, gpus_per_node: int) -> GroupLayout:
    """Layout of a group whose members are `stride` ranks apart (Megatron order: tp innermost,
    then cp, ulysses, dp, pp; a group's stride is the product of the degrees inside it)."""
    assert size >= 1 and stride >= 1 and gpus_per_node >= 1
    if size == 1:
        return GroupLayout(size=1, ranks_per_node=1)
    per_node = max(1, gpus_per_node // stride)
    return GroupLayout(size=size, ranks_per_node=min(size, per_node))


# ---- NVLink domain: what "crosses nodes" means here ----------------------------------------


def nvlink_group_layout(size: int, stride: int, cluster: ClusterSpec) -> GroupLayout:
    """group_layout with the cluster's NVLink domain as the "node": a group crosses nodes when
    it leaves the NVLink fabric (one DGX node; a whole 72-GPU GB200/GB300 NVL72 rack), so every
    group inside the domain runs at `intra_node` speed. Outside it each GPU has its own NIC
    (rails, as on DGX), so the q members of a domain drive q NICs in parallel."""
    return group_layout(size, stride, cluster.nvlink_domain)


ZERO3_NICS_PER_GPU = 1.0
"""ZeRO-3's per-layer all-gathers and reduce-scatters over a data-parallel group that spans
nodes move at one NIC's bandwidth per GPU, not the q-NIC aggregate a single large all-reduce
reaches. Calibrated on Narayanan et al. SC'21 Table 2 (DeepSpeed ZeRO-3, 384-2,240 A100s, one
micro-batch per GPU): 174.6B and 529.6B spend 66.7 s and ~182 s per micro-batch in traffic
whatever the GPU count, i.e. 2 + 2 + 4 bytes/param (two bf16 gathers, fp32 reduce-scatter) at
21-23 GB/s per GPU = one HDR NIC (the preset's inter_node 22 GB/s). MosaicML's FSDP rows
(llm-foundry, 128 x A100-40GB) stay compute-bound under it, as measured."""


ZERO3_OVERLAP = 0.7
"""Share of the shorter of (ZeRO-3 traffic, the compute it overlaps) that prefetching hides:
exposed = max(0, X - C) + (1 - ZERO3_OVERLAP) min(X, C). Concurrent NCCL kernels take SMs and
HBM bandwidth from the GEMMs, so overlap is never free. Calibrated on SC'21 Table 2: at 4
micro-batch samples per GPU ZeRO-3 runs at 138-144 TFLOP/s (compute-bound but slowed by the
traffic) against 153-171 for PTD-P on the same models; with 1-2 samples the time is the
traffic alone plus a little (174.6B: 66.7 s at 768 and 1,536 GPUs)."""


def zero3_exposed_s(traffic_s: ArrayLike, compute_s: ArrayLike) -> ArrayLike:
    """Seconds of ZeRO-3 traffic not hidden behind `compute_s` (see ZERO3_OVERLAP)."""
    return np.maximum(0.0, traffic_s - compute_s) + (1.0 - ZERO3_OVERLAP) * np.minimum(
        traffic_s, compute_s
    )


class CommModel(Protocol):
    """Seconds one collective takes; vectorised over `num_bytes`."""

    def time_s(
        self, collective: Collective, num_bytes: ArrayLike, layout: GroupLayout
    ) -> ArrayLike: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class AlphaBetaComm:
    """Ring/hierarchical collectives: time = latency * steps + volume / bus bandwidth.

    A group inside one node runs at the NVLink bus bandwidth. A group spanning n > 1 nodes with q
    members per node drives q NICs in parallel (one per GPU, as on DGX), so its bus bandwidth is
    min(intra, q * inter). Latency: q-1 intra-node ring steps plus ceil(log2 n) inter-node tree
    steps per reduce or gather phase (NCCL switches to trees at scale).
    """

    cluster: ClusterSpec
    """Link bandwidths and latencies."""

    def bus_bandwidth_bytes_per_s(self, layout: GroupLayout) -> float:
        intra = self.cluster.intra_node.bandwidth_bytes_per_s
        if not layout.crosses_nodes:
            return intra
        nics: float = layout.ranks_per_node
        if layout.nics_in_parallel is not None:
            nics = min(nics, layout.nics_in_parallel)
        return min(intra, nics * self.cluster.inter_node.bandwidth_bytes_per_s)

    def phase_latency_s(self, layout: GroupLayout) -> float:
        """Latency of one reduce or gather phase."""
        intra = (layout.ranks_per_node - 1) * self.cluster.intra_node.latency_s
        inter = math.ceil(math.log2(layout.num_nodes)) * self.cluster.inter_node.latency_s
        return intra + inter

    def time_s(
        self, collective: Collective, num_bytes: ArrayLike, layout: GroupLayout
    ) -> ArrayLike:
        p = layout.size
        if p == 1 and collective != "p2p":
            return num_bytes * 0.0
        bw = self.bus_bandwidth_bytes_per_s(layout)
        lat = self.phase_latency_s(layout)
        if collective == "all_reduce":
            return all_reduce_time_s(num_bytes, p, bw, lat)
        if collective in ("all_gather", "reduce_scatter"):
            return all_gather_time_s(num_bytes, p, bw, lat)
        if collective == "broadcast":
            return num_bytes / bw + lat
        if collective == "all_to_all":
            return self._all_to_all_s(num_bytes, layout)
        if collective == "p2p":
            link = self.cluster.inter_node if layout.crosses_nodes else self.cluster.intra_node
            return p2p_time_s(num_bytes, link.bandwidth_bytes_per_s, link.latency_s)
        raise ValueError(f"unknown collective {collective!r}")

    def _all_to_all_s(self, num_bytes: ArrayLike, layout: GroupLayout) -> ArrayLike:
        """Each rank sends N/p to every peer: (q-1)/p of N over NVLink, (p-q)/p of N through its
        own NIC; the two proceed concurrently."""
        p, q = layout.size, layout.ranks_per_node
        intra = self.cluster.intra_node
        inter = self.cluster.inter_node
        t_intra = (q - 1) / p * num_bytes / intra.bandwidth_bytes_per_s + (q - 1) * intra.latency_s
        if q == p:
            return t_intra
        t_inter = (p - q) / p * num_bytes / inter.bandwidth_bytes_per_s
        t_inter = t_inter + (layout.num_nodes - 1) * inter.latency_s
        return np.maximum(t_intra, t_inter)


def all_reduce_time_s(
    num_bytes: ArrayLike, p: int, bus_bw: float, phase_latency_s: float
) -> ArrayLike:
    """Ring all-reduce: 2 (p-1)/p N / busbw + 2 phases of latency."""
    return 2 * (p - 1) / p * num_bytes / bus_bw + 2 * phase_latency_s


def all_gather_time_s(
    num_bytes: ArrayLike, p: int, bus_bw: float, phase_latency_s: float
) -> ArrayLike:
    """Ring all-gather or reduce-scatter of an N-byte full buffer: (p-1)/p N / busbw + latency."""
    return (p - 1) / p * num_bytes / bus_bw + phase_latency_s


def p2p_time_s(num_bytes: ArrayLike, bandwidth_bytes_per_s: float, latency_s: float) -> ArrayLike:
    """One point-to-point message: alpha + N / beta."""
    return latency_s + num_bytes / bandwidth_bytes_per_s
