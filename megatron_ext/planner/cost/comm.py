"""Communication cost: collectives as NCCL runs them (per message size the cheapest ring or tree
under the LL, LL128 or Simple protocol, each a latency + bandwidth model, NCCL's own constants),
knowing when a group crosses nodes; inside an A100 node, all-reduces and ring gathers take
their measured time (measured_nccl.py: nccl-tests on 2-8 A100, which NCCL's tuning constants put
at 0.4-0.9x for the 1-32 MiB of a tensor-parallel block).

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

from megatron_ext.planner.cost.measured_nccl import measured_time_s, table_for
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


# NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel and
# ncclTopoGetAlgoTime, 2.10-2.12; the numbers NCCL uses to choose an algorithm and protocol per
# call): time = base latency + hops x hop latency + bytes / algorithm bandwidth, per (algorithm,
# protocol), the cheapest one run. Latencies in seconds; hop latencies of each protocol are kept
# as ratios to the Simple ring hop, which the cluster's LinkSpec.latency_s gives (presets: NCCL's
# 3.4 us over NVLink, 9.6 us over the network), so a measured link scales every protocol.
PROTOCOLS = ("LL", "LL128", "Simple")
BASE_LATENCY_S = {"ring": (3.6e-6, 10.0e-6, 8.4e-6), "tree": (4.4e-6, 4.4e-6, 0.0)}
"""baseLat[algorithm][protocol] (LL, LL128, Simple)."""
NVLINK_HOP = {"ring": (0.47, 1.9, 3.4), "tree": (0.52, 1.2, 28.0)}
"""hwLat[NVLINK] in us; divided by the Simple ring hop (3.4) to scale LinkSpec.latency_s."""
NET_HOP = {"ring": (2.7, 4.0, 9.6), "tree": (5.0, 8.5, 50.0)}
"""hwLat[NET] in us; divided by the Simple ring hop (9.6)."""
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0,
     1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9,
     1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9),
)
"""treeCorrectionFactor[protocol][log2(bytes / 64)]: trees reach less than their model's
bandwidth at medium sizes (64 B to 128 MiB; 1.0 above)."""
RING_PLATEAU = 1.9
"""A Simple ring all-reduce across nodes pays 1.9x its latency once the message exceeds
p/16 x 64 KiB (NCCL's "plateau effect of ring")."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AlphaBetaComm:
    """Collectives as NCCL runs them: per message size the cheapest of ring and tree (tree for
    all-reduce only, as NCCL) under the LL, LL128 and Simple protocols, each latency + bandwidth
    (module constants above, from NCCL's tuning model).

    Bandwidth: the Simple ring runs at the bus bandwidth (busbw in nccl-tests' sense) of the
    group: NVLink inside one node; across n > 1 nodes with q members per node the q NICs in
    parallel (one per GPU, as on DGX), min(intra, q * inter). LinkSpec bandwidths are the
    large-message busbw of NVIDIA's published nccl-tests (all_reduce_perf): DGX A100 ~230 GB/s
    (NCCL caps its A100 model at 235), DGX H100 ~360 GB/s inside a node; one HDR 200 Gb/s NIC
    per GPU ~22 GB/s, NDR 400 Gb/s ~45 GB/s. LL128 reaches 0.92 of it (0.7 with one GPU per
    node), LL a quarter (a third inside a node for gathers), a tree 0.9 x busbw / 2 of
    algorithm bandwidth. Latency: ring 2(p-1) hops for all-reduce, p-1 for gathers and reduce-
    scatters, 2(n-1) resp. n-1 of them over the network; tree 2((q-1) NVLink + log2 n network)
    hops. NCCL's constants choose its algorithm; they are not its measured time: inside an A100
    node nccl-tests shows 9-13% of peak busbw at 1 MiB and 64-80% at 32 MiB where they give
    ~25% and ~80%, so there the measured curve replaces them (measured_nccl.py, `formula_s` is
    the model alone).
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

    def _hops_s(self, algorithm: str, proto: int, layout: GroupLayout) -> tuple[float, float]:
        """(NVLink hop, network hop) latency of `algorithm` under protocol index `proto`."""
        intra = self.cluster.intra_node.latency_s * NVLINK_HOP[algorithm][proto] / 3.4
        inter = self.cluster.inter_node.latency_s * NET_HOP[algorithm][proto] / 9.6
        if layout.crosses_nodes and proto == 0:
            intra *= 1.8  # LL across nodes (NCCL)
        return intra, inter

    def ring_s(self, collective: str, num_bytes: ArrayLike, layout: GroupLayout,
               proto: int) -> ArrayLike:
        """Ring time of `collective` ("all_reduce", "all_gather", "reduce_scatter",
        "broadcast") under protocol index `proto` (0 LL, 1 LL128, 2 Simple)."""
        p, n = layout.size, layout.num_nodes
        busbw = self.bus_bandwidth_bytes_per_s(layout)
        if proto == 0:
            busbw /= 4.0 if (layout.crosses_nodes or collective == "all_reduce") else 3.0
        elif proto == 1:
            busbw *= 0.7 if layout.ranks_per_node < 2 and layout.crosses_nodes else 0.92
        intra, inter = self._hops_s("ring", proto, layout)
        base = BASE_LATENCY_S["ring"][proto]
        if collective == "broadcast":
            return base + p * (inter if layout.crosses_nodes else intra) + num_bytes / busbw
        steps, inter_steps = (2 * (p - 1), 2 * (n - 1)) if collective == "all_reduce" else (
            p - 1, n - 1)
        lat: ArrayLike = base + (steps - inter_steps) * intra + inter_steps * inter
        if collective == "all_reduce" and proto == 2 and layout.crosses_nodes:
            lat = np.where(num_bytes >= p / 16.0 * 65536, RING_PLATEAU * lat, lat)
        return lat + num_bytes * steps / p / busbw

    def tree_s(self, num_bytes: ArrayLike, layout: GroupLayout, proto: int) -> ArrayLike:
        """Tree all-reduce (reduce up, broadcast down a double binary tree across nodes, a
        chain inside each node) under protocol index `proto`."""
        busbw = 0.9 * self.bus_bandwidth_bytes_per_s(layout)
        if proto == 0:
            busbw /= 3.8
        elif proto == 1:
            busbw *= 0.915 if layout.crosses_nodes else 7.0 / 9.0
        intra, inter = self._hops_s("tree", proto, layout)
        q, n = layout.ranks_per_node, layout.num_nodes
        lat = BASE_LATENCY_S["tree"][proto] + 2 * ((q - 1) * intra
                                                   + math.ceil(math.log2(n)) * inter)
        size = np.log2(np.maximum(np.asarray(num_bytes, dtype=float), 64.0) / 64.0)
        index = np.minimum(np.floor(size).astype(np.int64), len(TREE_CORRECTION[proto]))
        factor = np.asarray(TREE_CORRECTION[proto] + (1.0,))[index]
        return lat + num_bytes / (0.5 * busbw * factor)

    def time_s(
        self, collective: Collective, num_bytes: ArrayLike, layout: GroupLayout
    ) -> ArrayLike:
        p = layout.size
        if p == 1 and collective != "p2p":
            return num_bytes * 0.0
        if collective in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            link = self.cluster.intra_node
            table = None if layout.crosses_nodes or collective == "broadcast" else table_for(
                self.cluster.name, (link.bandwidth_bytes_per_s, link.latency_s), p)
            if table is not None:
                return measured_time_s(table, collective, num_bytes,
                                       lambda n: self.formula_s(collective, n, layout))
            return self.formula_s(collective, num_bytes, layout)
        if collective == "all_to_all":
            return self._all_to_all_s(num_bytes, layout)
        if collective == "p2p":
            link = self.cluster.inter_node if layout.crosses_nodes else self.cluster.intra_node
            return p2p_time_s(num_bytes, link.bandwidth_bytes_per_s, link.latency_s)
        raise ValueError(f"unknown collective {collective!r}")

    def formula_s(self, collective: str, num_bytes: ArrayLike, layout: GroupLayout
                  ) -> ArrayLike:
        """NCCL's tuning model of a ring / tree collective: the cheapest algorithm and
        protocol (all_reduce, all_gather, reduce_scatter, broadcast)."""
        best = self.ring_s(collective, num_bytes, layout, 2)
        for proto in (0, 1):
            best = np.minimum(best, self.ring_s(collective, num_bytes, layout, proto))
        if collective == "all_reduce" and layout.crosses_nodes:
            for proto in (0, 1, 2):
                best = np.minimum(best, self.tree_s(num_bytes, layout, proto))
        return best if isinstance(best, np.ndarray) and best.ndim else float(best)

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


def p2p_time_s(num_bytes: ArrayLike, bandwidth_bytes_per_s: float, latency_s: float) -> ArrayLike:
    """One point-to-point message: alpha + N / beta."""
    return latency_s + num_bytes / bandwidth_bytes_per_s
