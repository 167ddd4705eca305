"""Compute cost: FLOPs of each layer part and the time they take at a given efficiency.

Legend: b = samples per data-parallel replica, s = sequence length, m = tokens one GPU feeds
through its linear layers (b * s / (cp * ulysses)), h = hidden, q = heads * head_dim,
kv = query_groups * head_dim, f = ffn hidden, V = padded vocabulary, t = tp.
Functions are vectorised: degrees and token counts may be numpy arrays of strategies.

Time = GEMM FLOPs / (peak * gemm efficiency) + attention FLOPs / (peak * attention efficiency)
+ elementwise bytes / HBM bandwidth. GEMM efficiency saturates with the smallest GEMM dimension
(small TP shards and few tokens run below peak). Backward GEMMs cost 2x forward FLOPs; flash
attention backward costs 2.5x its forward (it recomputes the scores). A model profile
(`ComputeProfile`) replaces the efficiencies and the HBM bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_ext.schema import expect_object, get_float, reject_unknown
from megatron_ext.specs import ClusterSpec, ModelSpec

ArrayLike = float | np.ndarray

# Measured-class HBM bandwidths of the preset GPUs (bytes/s); other clusters use peak / 300.
_HBM_BYTES_PER_S = {
    "dgx-a100-40g": 1.55e12,
    "dgx-a100-80g": 2.0e12,
    "dgx-h100": 3.35e12,
    "dgx-h200": 4.8e12,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeProfile:
    """Efficiencies of the GPU on this model's kernels; a model profile overrides the defaults."""

    gemm_efficiency: float = 0.68
    """Fraction of dense peak a large GEMM reaches."""
    gemm_half_dim: float = 128.0
    """A GEMM whose smallest dimension is x reaches gemm_efficiency * x / (x + gemm_half_dim)."""
    attention_efficiency: float = 0.55
    """Fraction of peak of fused (flash) attention forward."""
    attention_backward_efficiency: float = 0.45
    """Fraction of peak of fused attention backward."""
    hbm_bytes_per_s: float = 0.0
    """Achievable HBM bandwidth for elementwise kernels; 0 means a guess from the cluster."""
    fp32_flops_ratio: float = 0.5
    """Peak of fp32 (TF32) GEMMs relative to bf16 peak."""

    @classmethod
    def from_dict(cls, data: Any, path: str = "compute") -> ComputeProfile:
        data = expect_object(data, path)
        reject_unknown(data, set(cls.__dataclass_fields__), path)
        defaults = cls()
        return cls(
            **{
                name: get_float(
                    data,
                    name,
                    path,
                    default=getattr(defaults, name),
                    positive=name != "hbm_bytes_per_s",
                )
                for name in cls.__dataclass_fields__
            }
        )

    def hbm_for(self, cluster: ClusterSpec) -> float:
        if self.hbm_bytes_per_s > 0:
            return self.hbm_bytes_per_s
        return _HBM_BYTES_PER_S.get(cluster.name, cluster.peak_flops / 300.0)


# ---- model shape ----------------------------------------------------------------------------


def q_dim(model: ModelSpec) -> int:
    return model.num_attention_heads * model.head_dim


def kv_dim(model: ModelSpec) -> int:
    return model.num_query_groups * model.head_dim


def layer_matmul_params(model: ModelSpec) -> int:
    """Weights of one transformer layer's GEMMs: QKV, output projection, MLP."""
    h, f = model.hidden_size, model.ffn_hidden_size
    attention = h * (q_dim(model) + 2 * kv_dim(model)) + q_dim(model) * h
    mlp = h * f * (3 if model.activation == "swiglu" else 2)
    return attention + mlp


def layer_params(model: ModelSpec) -> int:
    """All parameters of one transformer layer (GEMMs, biases, norms)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    norms = 2 * h * (2 if model.normalization == "LayerNorm" else 1)
    biases = 0
    if model.add_bias_linear:
        biases = (
            q_dim(model)
            + 2 * kv_dim(model)
            + h
            + f * (2 if model.activation == "swiglu" else 1)
            + h
        )
    return layer_matmul_params(model) + norms + biases


def padded_vocab_size(model: ModelSpec, num_shards: int) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x (ranks sharing it)."""
    multiple = 128 * num_shards
    return math.ceil(model.vocab_size / multiple) * multiple


def model_flops_per_token(model: ModelSpec, seq_length: int) -> float:
    """Training FLOPs per token for MFU: 6 x (layer GEMM weights + output layer) plus causal
    attention 6 * s * q per layer (half of the s x s score matrix); recomputation not counted."""
    per_layer = 6 * layer_matmul_params(model) + 6 * seq_length * q_dim(model)
    return model.num_layers * per_layer + 6 * model.hidden_size * model.vocab_size


# ---- transformer layer ----------------------------------------------------------------------


def gemm_efficiency(profile: ComputeProfile, smallest_dim: ArrayLike) -> ArrayLike:
    return profile.gemm_efficiency * smallest_dim / (smallest_dim + profile.gemm_half_dim)


def layer_gemm_forward_flops(model: ModelSpec, tokens: ArrayLike, tp: ArrayLike) -> ArrayLike:
    """2 * m * (layer GEMM weights) / t on one GPU."""
    return 2.0 * tokens * layer_matmul_params(model) / tp


def attention_forward_flops(
    model: ModelSpec, b: ArrayLike, seq_length: int, shards: ArrayLike
) -> ArrayLike:
    """Causal QK^T and AV: 2 * b * s^2 * q per replica (half of 4 b s^2 q), split over
    `shards` = tp * cp * ulysses GPUs."""
    return 2.0 * b * seq_length**2 * q_dim(model) / shards


def layer_elementwise_bytes(
    model: ModelSpec, tokens: ArrayLike, tp: ArrayLike, sp: ArrayLike, element_bytes: int
) -> ArrayLike:
    """HBM traffic of one forward: ~15 passes over [m, h] (2 norms, 2 residual adds, 2 dropouts;
    split over t only under sequence parallelism), the activation function over [m, f/t]
    (3 passes for swiglu, 2 for gelu), rotary embedding over q and k ([m, (q+kv)/t], 2 passes)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    hidden = 15.0 * tokens * h / np.where(sp, tp, 1)
    act = (3.0 if model.activation == "swiglu" else 2.0) * tokens * f / tp
    rope = (
        2.0 * tokens * (q_dim(model) + kv_dim(model)) / tp
        if model.position_embedding == "rope"
        else 0.0
    )
    return element_bytes * (hidden + act + rope)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCompute:
    """Compute-only seconds of one layer for one micro-batch on one GPU (vectorised)."""

    forward_s: ArrayLike
    """GEMMs + attention + elementwise, forward."""
    backward_s: ArrayLike
    """The same, backward (without recomputation)."""
    attention_forward_s: ArrayLike
    """Core attention forward alone: selective recomputation repeats it; CP overlaps with it."""


def layer_compute(
    model: ModelSpec,
    cluster: ClusterSpec,
    profile: ComputeProfile,
    *,
    b: ArrayLike,
    seq_length: int,
    tp: ArrayLike,
    sp: ArrayLike,
    seq_shards: ArrayLike,
    element_bytes: int,
) -> LayerCompute:
    """Per-GPU compute time of one transformer layer; `seq_shards` = cp * ulysses."""
    peak = cluster.peak_flops * (1.0 if element_bytes == 2 else profile.fp32_flops_ratio)
    tokens = b * seq_length / seq_shards
    smallest = np.minimum(tokens, min(model.hidden_size, q_dim(model), model.ffn_hidden_size) / tp)
    gemm_s = layer_gemm_forward_flops(model, tokens, tp) / (
        peak * gemm_efficiency(profile, smallest)
    )
    attn_flops = attention_forward_flops(model, b, seq_length, tp * seq_shards)
    attn_s = attn_flops / (peak * profile.attention_efficiency)
    attn_bwd_s = 2.5 * attn_flops / (peak * profile.attention_backward_efficiency)
    elem_s = layer_elementwise_bytes(model, tokens, tp, sp, element_bytes) / profile.hbm_for(
        cluster
    )
    return LayerCompute(
        forward_s=gemm_s + attn_s + elem_s,
        backward_s=2.0 * gemm_s + attn_bwd_s + 2.0 * elem_s,
        attention_forward_s=attn_s,
    )


# ---- vocabulary layers ----------------------------------------------------------------------


def output_layer_compute_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    profile: ComputeProfile,
    *,
    tokens: float,
    vocab_shard: float,
    element_bytes: int,
) -> tuple[float, float]:
    """(forward, backward) seconds of the output GEMM plus softmax cross-entropy on a
    [tokens, vocab_shard] logits shard: GEMM 2 * tokens * h * V_shard FLOPs forward, 2x backward;
    cross-entropy ~24 bytes of fp32 traffic per logit forward, ~12 backward."""
    peak = cluster.peak_flops * (1.0 if element_bytes == 2 else profile.fp32_flops_ratio)
    smallest = min(tokens, vocab_shard, model.hidden_size)
    gemm_s = (
        2.0 * tokens * model.hidden_size * vocab_shard / (peak * gemm_efficiency(profile, smallest))
    )
    logits = tokens * vocab_shard
    hbm = profile.hbm_for(cluster)
    return gemm_s + 24.0 * logits / hbm, 2.0 * gemm_s + 12.0 * logits / hbm


def embedding_compute_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    profile: ComputeProfile,
    *,
    tokens: float,
    element_bytes: int,
) -> tuple[float, float]:
    """(forward, backward) of the embedding lookup: gather [tokens, h] rows; scatter-add their
    fp32 gradient. Memory-bound."""
    hbm = profile.hbm_for(cluster)
    rows = tokens * model.hidden_size
    return 2.0 * element_bytes * rows / hbm, (element_bytes + 8.0) * rows / hbm


def optimizer_step_s(
    num_params: ArrayLike, cluster: ClusterSpec, profile: ComputeProfile
) -> ArrayLike:
    """Adam on this GPU's shard: ~30 bytes of HBM traffic per parameter (read fp32 master, grad,
    two moments; write master, moments and the half-precision copy)."""
    return 30.0 * num_params / profile.hbm_for(cluster)
