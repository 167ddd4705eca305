"""FP8 in the cost model: GEMM time at the GPU's FP8 rate, quantisation, and what each recipe
keeps in memory (Transformer Engine v2.9 under Megatron-LM core_v0.16.1).

Legend as compute.py: m = tokens a rank feeds through a GEMM, (k, n) its weight, x = min(m, k,
n); b = samples per replica; t = tp. Vectorised over strategies.

Time of one FP8 layer = the bf16 layer (compute.layer_compute) with its four weight GEMMs
replaced by:
- FP8 GEMMs at `cluster.peak_fp8_flops` x E8 x x / (x + FP8_GEMM_HALF_DIM), E8 =
  ComputeProfile.fp8_gemm_efficiency:
  forward (fprop), backward dgrad and wgrad; wgrad runs bf16 with the delayed recipe's
  --no-fp8-wgrad. A GEMM whose smallest side is x gains
  speedup(x) = (peak8 / peak) (E8 / E) (x + H) / (x + H8) over bf16 (E, H: the bf16 profile's
  gemm_efficiency / gemm_half_dim): with the defaults 1.64x at x = 8192, 1.39x at 512, 1.11x at
  128 on H100 -- small per-rank GEMMs gain less, and a whole layer less again once the
  quantisation passes below are added (torchtitan measures 1.28-1.29x end to end for Llama 3.1
  8B on H100, benchmarks/llama3_h100_202412_torchtitan.md Tables 1 and 3).
- quantisation, memory-bound at the HBM bandwidth: each GEMM input X [m, k] is read in bf16 and
  written twice in FP8 (row-wise for fprop, column-wise for wgrad): 4 m k bytes; each output
  gradient dY [m, n] likewise, 4 m n. Current scaling (tensorwise) reads each tensor once more
  for its amax first (+2 bytes per element); delayed scaling takes the scale from the amax
  history (its amax reduction is one small all-reduce per step, not priced), blockwise and
  mxfp8 compute block scales inside the cast kernel. Weights are cast once per step, not per
  micro-batch (Megatron-LM passes is_first_microbatch), and are not priced.
Attention, norms, element-wise kernels, the embedding and the output layer stay bf16 (as
Megatron-LM's TE layers do without fp8_dot_product_attention).

Memory per weight-GEMM parameter of an FP8 layer (docs/fp8.md; reference: TE tensor classes):
+ 1 B FP8 row-wise copy, + 1 B column-wise copy unless the GPU runs non-TN FP8 GEMMs
(Blackwell) with a per-tensor recipe (delayed / tensorwise); blockwise and mxfp8 keep both.
--fp8-param-gather drops the 2 B bf16 weight (the FP8 copy is the parameter) and its ZeRO-1
all-gather moves 1 B per weight-GEMM parameter. Activations: the four GEMM inputs are saved in
FP8 (1 B instead of 2) unless the layer recomputes in full (which keeps only its input).

Mixture-of-Experts layers (cost/moe.py): in an FP8 layer the attention projections, the routed
experts' grouped GEMMs (one GEMM per local expert at its own token count) and the shared experts
run at the FP8 GEMM model above (moe_fp8_delta_s); the router stays bf16. Their FP8 weight copies
and FP8-saved activations are not priced yet (MoE memory is the bf16 layer's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from megatron_ext.planner.cost import compute as C
from megatron_ext.planner.cost.compute import FP8_GEMM_EFFICIENCY  # noqa: F401  (re-exported)
from megatron_ext.specs import ClusterSpec, FP8Spec, ModelSpec

FP8_GEMM_HALF_DIM = 256.0
"""x at which an FP8 GEMM reaches half of FP8_GEMM_EFFICIENCY: twice the bf16 profile's 128,
since the tensor cores finish each tile's math in half the time and the fixed per-tile work
(loads, scaling, epilogue) stays: an FP8 GEMM needs about twice the work per tile to saturate."""

QUANT_BYTES_PER_ELEMENT = 4.0
"""HBM bytes to cast one bf16 element into row- and column-wise FP8 copies (read 2, write 1+1)."""
AMAX_BYTES_PER_ELEMENT = 2.0
"""The extra read of current scaling (tensorwise) for the tensor's amax."""


def blackwell(cluster: ClusterSpec) -> bool:
    """GPUs that run non-TN FP8 GEMMs (no transposed weight copy) and mxfp8: Blackwell, known
    here by its mxfp8 support (presets.py)."""
    return "mxfp8" in cluster.fp8_recipes


def weight_copy_bytes(fp8: FP8Spec, cluster: ClusterSpec) -> float:
    """Bytes per weight-GEMM parameter of the FP8 copies Transformer Engine keeps."""
    both = fp8.recipe in ("blockwise", "mxfp8") or not blackwell(cluster)
    return 2.0 if both else 1.0


def fp8_gemm_efficiency(smallest_dim: Any, large: float = FP8_GEMM_EFFICIENCY) -> Any:
    """Share of the FP8 peak an FP8 GEMM whose smallest side is `smallest_dim` reaches, `large`
    for large GEMMs (ComputeProfile.fp8_gemm_efficiency)."""
    return large * smallest_dim / (smallest_dim + FP8_GEMM_HALF_DIM)


def gemm_times_s(model: ModelSpec, profile: C.ComputeProfile, cluster: ClusterSpec, fp8: FP8Spec, *,
                 tokens: Any, tp: Any) -> tuple[Any, Any, Any, Any]:
    """(bf16 forward, bf16 backward, FP8 forward, FP8 backward) seconds of the layer's four
    weight GEMMs, FP8 including its quantisation passes."""
    return shapes_times_s(profile, cluster, fp8, [(tokens, k, n) for k, n in
                                                   C.layer_gemms(model, tp)])


def shapes_times_s(profile: C.ComputeProfile, cluster: ClusterSpec, fp8: FP8Spec,
                   shapes: list[tuple[Any, Any, Any]], *, count: Any = 1.0
                   ) -> tuple[Any, Any, Any, Any]:
    """(bf16 forward, bf16 backward, FP8 forward, FP8 backward) seconds of `count` times the
    GEMMs [m, k] x [k, n] of `shapes` (m, k, n), FP8 with its quantisation passes (module
    doc). `count` > 1: a grouped GEMM of that many equal experts (each at its own shape's
    efficiency, as Transformer Engine's grouped GEMM runs one GEMM per expert)."""
    peak, peak8 = cluster.peak_flops, cluster.peak_fp8_flops
    hbm = profile.hbm_for(cluster)
    cast = QUANT_BYTES_PER_ELEMENT + (AMAX_BYTES_PER_ELEMENT if fp8.recipe == "tensorwise"
                                      else 0.0)
    bf_f = bf_b = f8_f = f8_b = 0.0
    for tokens, k, n in shapes:
        x = np.minimum(np.minimum(tokens, k), n)
        flops = 2.0 * tokens * k * n
        bf = flops / (peak * C.gemm_efficiency(profile, x))
        f8 = flops / (peak8 * fp8_gemm_efficiency(x, profile.fp8_gemm_efficiency))
        bf_f, bf_b = bf_f + bf, bf_b + 2.0 * bf
        f8_f = f8_f + f8 + cast * tokens * k / hbm
        wgrad = f8 if fp8.wgrad else bf
        f8_b = f8_b + f8 + wgrad + cast * tokens * n / hbm
    return bf_f * count, bf_b * count, f8_f * count, f8_b * count


def moe_fp8_delta_s(cm: Any, table: Any, *, rows: Any, per_expert: Any, local: Any
                    ) -> tuple[Any, Any]:
    """(forward, backward) seconds an FP8 MoE layer saves (negative) or adds over its bf16
    pricing in cost/moe.py: the attention block's weight GEMMs (QKV / MLA projections and the
    output projection, `rows` tokens), the routed experts' grouped GEMMs (`local` experts of
    `per_expert` rows each: fc1 [rows, h] x [h, u f / etp], fc2 [rows, f / etp] x
    [f / etp, h]) and the shared experts (TP-sharded, `rows` tokens), each at the FP8 GEMM
    model with its quantisation. The router stays bf16 (Megatron-LM's router is not a
    Transformer Engine module)."""
    m, fp8 = cm.model, cm.training.fp8
    moe = m.moe
    h, u = m.hidden_size, (2 if m.activation == "swiglu" else 1)
    f, f_s, et, tp = moe.expert_ffn_hidden_size(m), moe.shared_expert_intermediate_size, \
        table.etp, table.tp
    attention = [(rows, k, n) for k, n in C.layer_gemms(m, tp)[:-2]]
    shapes = attention + ([(rows, h, u * f_s / tp), (rows, f_s / tp, h)] if f_s else [])
    a = shapes_times_s(cm.compute, cm.cluster, fp8, shapes)
    e = shapes_times_s(cm.compute, cm.cluster, fp8,
                       [(per_expert, h, u * f / et), (per_expert, f / et, h)], count=local)
    return (a[2] - a[0]) + (e[2] - e[0]), (a[3] - a[1]) + (e[3] - e[1])


def fp8_layer_costs(cm: Any, table: Any, b: Any, costs: Any) -> Any:
    """`costs` (cost model LayerCosts of a dense layer in bf16) as the layer costs in FP8."""
    fp8: FP8Spec = cm.training.fp8
    m, t, cluster = cm.model, cm.training, cm.cluster
    shards = table.cp * table.ulysses
    rows = b * t.seq_length / shards
    bf_f, bf_b, f8_f, f8_b = gemm_times_s(m, cm.compute, cluster, fp8, tokens=rows, tp=table.tp)
    d_f, d_b = f8_f - bf_f, f8_b - bf_b
    full = table.recompute == 2
    recompute = costs.recompute_s + np.where(full, d_f, 0.0)
    gemm_params = C.layer_matmul_params(m) / table.tp
    copies = weight_copy_bytes(fp8, cluster) - (2.0 if fp8.param_gather else 0.0)
    sp_div = np.where(table.sp, table.tp, 1)
    saved_none = rows * (2.0 * m.hidden_size / sp_div
                         + (C.q_dim(m) + m.ffn_hidden_size) / table.tp) * (cm.element_bytes - 1)
    saved = np.where(full, 0.0, saved_none)
    gather = costs.param_gather_s
    if fp8.param_gather:  # weight-GEMM parameters gathered at 1 B instead of 2
        share = C.layer_matmul_params(m) / C.layer_params(m)
        gather = gather * (1.0 - share / 2.0)
    return dataclasses.replace(
        costs,
        forward_s=costs.forward_s + d_f,
        backward_s=costs.backward_s + d_b + np.where(full, d_f, 0.0),
        recompute_s=recompute,
        param_gather_s=gather,
        state_bytes=costs.state_bytes + copies * gemm_params,
        activation_bytes=costs.activation_bytes - saved,
        # recomputation rebuilds the activations in FP8 too
        transient_bytes=costs.transient_bytes - np.where(full, saved_none, 0.0),
    )
