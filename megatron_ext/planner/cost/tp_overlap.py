"""Megatron-LM's --tp-comm-overlap: Transformer Engine's userbuffers pipeline each
sequence-parallel all-gather / reduce-scatter of a layer with the GEMM it feeds or follows.

Legend: c = one all-gather or reduce-scatter of the layer's [s, b, h] activation over the TP group
(what the cost model puts on the critical path without the flag), g = the GEMM that hides it,
n = chunks, t = tp. Vectorised over strategies.

Which GEMM hides which collective is Transformer Engine's default userbuffers configuration
(transformer_engine/pytorch/module/base.py, initialize_ub, v1.6-v2.x), per block (attention:
QKV -> projection; MLP: FC1 -> FC2):
- forward: the all-gather feeding QKV / FC1 is a ring exchange of t chunks with that GEMM
  (method "ring_exchange": copy engines, no SMs taken from the GEMM); the reduce-scatter after
  the projection / FC2 is pipelined in PIPELINE_SPLITS chunks with that GEMM (method
  "pipeline", COMM_SMS SMs reserved, the GEMM runs on the rest);
- backward: the all-gather of the output gradient before the projection's / FC2's dgrad is a
  ring exchange with that dgrad (t chunks); the reduce-scatter of QKV's / FC1's input gradient
  runs beside their wgrad (method "bulk": not chunked, COMM_SMS SMs reserved);
- the recomputed forward of full recomputation: as the forward.
A dgrad and a wgrad have the forward GEMM's FLOPs and shape class, so each is priced as the
forward GEMM (FP8: at the FP8 GEMM model, wgrad in bf16 under --no-fp8-wgrad).

Exposed time of one collective (the rest runs under its GEMM):
- pipelined in n chunks: max(c, g) + min(c, g) / n - g = max(0, c - g) + min(c, g) / n: the
  longer stream runs throughout and one chunk of the shorter is not overlapped (the first
  chunk's transfer before its GEMM, or the last GEMM chunk after its data);
- bulk: max(0, c - g);
- plus, where the overlap reserves SMs, the GEMM's slowdown g (S / (S - COMM_SMS) - 1), S the
  GPU's SMs, and the hiding GEMM is the slowed one.
MoE layers (cost/moe.py) keep their TP collectives on the critical path: not credited.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_ext.planner.cost import compute as C
from megatron_ext.planner.cost.fp8 import fp8_gemm_efficiency
from megatron_ext.specs import ClusterSpec

if TYPE_CHECKING:
    from megatron_ext.planner.cost.model import CostModel
    from megatron_ext.planner.space import StrategyTable

COMM_SMS = 16
"""SMs a "pipeline" or "bulk" userbuffers overlap gives its communication kernel and takes from
the GEMM beside it: Transformer Engine's default num_sm = 16 with set_sm_margin for both
methods (initialize_ub's default config); "ring_exchange" uses 1 SM and no margin."""
PIPELINE_SPLITS = 4
"""Chunks of a pipelined reduce-scatter: Transformer Engine's default num_splits for the
"pipeline" method (the ring exchange uses tp chunks)."""
GPU_SMS = {"dgx-a100-40g": 108, "dgx-a100-80g": 108, "dgx-h100": 132, "dgx-h200": 132,
           "dgx-b200": 148, "gb200-nvl72": 148, "gb300-nvl72": 148}
"""Streaming multiprocessors per GPU of each preset (NVIDIA's A100, H100 SXM and B200
specifications; GB300's B300 taken as B200's 148, the SM margin moving by under a point if it
has the full die's 160)."""
DEFAULT_SMS = 132
"""A cluster that is not a preset: H100's."""


def gpu_sms(cluster: ClusterSpec) -> int:
    return GPU_SMS.get(cluster.name, DEFAULT_SMS)


def pipelined_exposed_s(comm_s: Any, gemm_s: Any, num_chunks: Any) -> Any:
    """Exposed seconds of a collective split into `num_chunks` chunks pipelined with a GEMM."""
    return np.maximum(0.0, comm_s - gemm_s) + np.minimum(comm_s, gemm_s) / num_chunks


def bulk_exposed_s(comm_s: Any, gemm_s: Any) -> Any:
    """Exposed seconds of a collective run beside a whole GEMM (not chunked)."""
    return np.maximum(0.0, comm_s - gemm_s)


def sp_regather_exposed_s(cm: CostModel, table: StrategyTable, rows: Any, all_gather_s: Any
                          ) -> Any:
    """Exposed seconds of sequence parallelism's backward re-gathers without userbuffers: a
    column-parallel linear keeps only its sequence shard of the input, so its backward
    all-gathers it again for the weight gradient (megatron-core's
    LinearWithGradAccumulationAndAsyncCommunication and Transformer Engine's Linear alike),
    asynchronously beside its input-gradient GEMM. Two per layer (QKV and MLP-in), each exposed
    by what outlasts that GEMM, the transfer stretched by the overlap slowdown as the other
    overlapped transfers are."""
    stretched = cm.overlap_slowdown * all_gather_s
    return sum(bulk_exposed_s(stretched, dgrad) for dgrad, _, _ in _block_gemms_s(cm, table, rows))


def _block_gemms_s(cm: CostModel, table: StrategyTable, rows: Any
                   ) -> list[tuple[Any, Any, Any]]:
    """(fprop = dgrad, wgrad) seconds of each block's first and last GEMM as
    [(in_fprop, in_wgrad, out_fprop)] for the attention block and the MLP: the first GEMM is
    QKV (MLA: its first query GEMM) / FC1, the last the output projection / FC2."""
    gemms = C.layer_gemms(cm.model, table.tp)
    fp8 = cm.training.fp8
    profile, cluster = cm.compute, cm.cluster
    peak = cluster.peak_flops * (1.0 if cm.element_bytes == 2 else profile.fp32_flops_ratio)

    def times(k: Any, n: Any) -> tuple[Any, Any]:
        x = np.minimum(np.minimum(rows, k), n)
        flops = 2.0 * rows * k * n
        bf16 = flops / (peak * C.gemm_efficiency(profile, x))
        if fp8 is None:
            return bf16, bf16
        f8 = flops / (cluster.peak_fp8_flops * fp8_gemm_efficiency(x, profile.fp8_gemm_efficiency))
        return f8, f8 if fp8.wgrad else bf16

    attn_in, mlp_in = times(*gemms[0]), times(*gemms[-2])
    attn_out, mlp_out = times(*gemms[-3]), times(*gemms[-1])
    return [(attn_in[0], attn_in[1], attn_out[0]), (mlp_in[0], mlp_in[1], mlp_out[0])]


def overlapped_tp_s(cm: CostModel, table: StrategyTable, rows: Any, collective_s: Any
                    ) -> tuple[Any, Any]:
    """(forward, backward) exposed seconds of a layer's four sequence-parallel collectives
    (`collective_s` each, [S]) under --tp-comm-overlap (module docstring); the recomputed
    forward is the forward's."""
    c, t = collective_s, table.tp
    slow = gpu_sms(cm.cluster) / (gpu_sms(cm.cluster) - COMM_SMS)  # GEMM beside a margin
    fwd: Any = 0.0
    bwd: Any = 0.0
    for in_s, in_wgrad_s, out_s in _block_gemms_s(cm, table, rows):
        out_slow, wgrad_slow = out_s * slow, in_wgrad_s * slow
        fwd = fwd + (pipelined_exposed_s(c, in_s, t)  # AG -> QKV / FC1
                     + (out_slow - out_s) + pipelined_exposed_s(c, out_slow, PIPELINE_SPLITS))
        bwd = bwd + (pipelined_exposed_s(c, out_s, t)  # AG of dY -> proj / FC2 dgrad
                     + (wgrad_slow - in_wgrad_s) + bulk_exposed_s(c, wgrad_slow))
    return fwd, bwd
