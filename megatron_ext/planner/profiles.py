"""Cluster profile files: measured links and kernels that override the presets' formulas.

Shape (schema_version 1; everything but `cluster` optional):
  {"schema_version": 1,
   "cluster": {ClusterSpec fields: name, num_nodes, gpus_per_node, memory_gib, peak_flops,
               intra_node {bandwidth_bytes_per_s, latency_s}, inter_node {...}},
   "collectives": [{"collective": "all_reduce", "group_size": 8, "ranks_per_node": 8,
                    "num_bytes": [...], "seconds": [...]}, ...],
   "compute": {ComputeProfile fields: gemm_efficiency, gemm_half_dim, attention_efficiency,
               attention_backward_efficiency, hbm_bytes_per_s, fp32_flops_ratio}}
A bare ClusterSpec object is accepted too. `collectives` become a MeasuredComm (the alpha-beta
formula stays for layouts not measured); `compute` becomes the ComputeProfile.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_ext.errors import PlanError
from megatron_ext.planner.cost.comm import (
    AlphaBetaComm,
    CommModel,
    MeasuredComm,
    curves_from_json,
)
from megatron_ext.planner.cost.compute import ComputeProfile
from megatron_ext.schema import get_int, load_json_file, reject_unknown
from megatron_ext.specs import ClusterSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterProfile:
    """A cluster with its optional measured communication and compute profiles."""

    cluster: ClusterSpec
    """Topology, memory, peak and the alpha-beta links."""
    comm: CommModel | None = None
    """Measured collectives (None: alpha-beta from `cluster`)."""
    compute: ComputeProfile | None = None
    """Measured kernel efficiencies (None: the defaults)."""


def load_cluster_profile(path: str | Path) -> ClusterProfile:
    data = load_json_file(path, "cluster profile")
    if "intra_node" in data:
        return ClusterProfile(cluster=ClusterSpec.from_dict(data, "cluster profile"))
    reject_unknown(data, {"schema_version", "cluster", "collectives", "compute"}, "")
    version = get_int(data, "schema_version", "", default=1)
    if version != 1:
        raise PlanError(f"cluster profile schema_version={version} is not supported; use 1")
    cluster = ClusterSpec.from_dict(data.get("cluster"), "cluster")
    comm = None
    if data.get("collectives") is not None:
        comm = MeasuredComm(
            curves=curves_from_json(data["collectives"]), fallback=AlphaBetaComm(cluster=cluster)
        )
    compute = ComputeProfile.from_dict(data["compute"]) if data.get("compute") is not None else None
    return ClusterProfile(cluster=cluster, comm=comm, compute=compute)
