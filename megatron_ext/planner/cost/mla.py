"""Multi-latent attention (MLA) in the cost model: parameters, GEMMs, attention FLOPs, activations.

megatron-core 0.16.1's MLASelfAttention (transformer/multi_latent_attention.py) per layer, with
n = heads, h = hidden, r_q = q_lora_rank, r_kv = kv_lora_rank, d_nope = qk_head_dim,
d_rope = qk_pos_emb_head_dim, d_q = d_nope + d_rope, d_v = v_head_dim, t = tp:

  linear_q_down_proj   h -> r_q                  (or linear_q_proj h -> n d_q without r_q)
  q_layernorm          r_q                        (--qk-layernorm; IdentityOp without)
  linear_q_up_proj     r_q -> n d_q               column-parallel
  linear_kv_down_proj  h -> r_kv + d_rope         (the compressed KV and the shared RoPE key)
  kv_layernorm         r_kv                       (--qk-layernorm; IdentityOp without)
  linear_kv_up_proj    r_kv -> n (d_nope + d_v)   column-parallel
  core attention       q, k: n d_q per token; v: n d_v (RoPE on the d_rope part only)
  linear_proj          n d_v -> h                 row-parallel

The down projections are column-parallel followed by an all-gather of the latent on the local
spec (gpt_layer_specs.py:366-391) and replicated (TELinear parallel_mode='duplicated') on the
Transformer Engine spec, which then runs them on the sequence-parallel shard of the tokens. Both
do r/t of the full-sequence GEMM per GPU under sequence parallelism, so the GEMM list below
splits them by t. Weights are counted split by t as on the local spec; the TE spec's replicated
copies add h (r_q + r_kv + d_rope) (1 - 1/t) per layer per GPU that this model leaves out
(about 5% of DeepSeek-V3's attention weights at t = 8). Nothing here imports torch.
"""

from __future__ import annotations

import numpy as np

from megatron_ext.specs import MLASpec, ModelSpec

ArrayLike = float | np.ndarray  # as compute.py: a scalar or one value per strategy

__all__ = ["attention_dim", "attention_params", "gemms", "rope_elements", "saved_widths"]


def _mla(model: ModelSpec) -> MLASpec:
    assert model.mla is not None
    return model.mla


def attention_matmul_params(model: ModelSpec) -> int:
    """Weights of the attention GEMMs (down, up and output projections)."""
    m, h, n = _mla(model), model.hidden_size, model.num_attention_heads
    if m.q_lora_rank is None:
        query = h * n * m.q_head_dim()
    else:
        query = h * m.q_lora_rank + m.q_lora_rank * n * m.q_head_dim()
    kv = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * n * (
        m.qk_head_dim + m.v_head_dim)
    return query + kv + n * m.v_head_dim * h


def attention_params(model: ModelSpec) -> int:
    """All attention parameters: the GEMMs, the latent norms (--qk-layernorm) and the output
    projection's bias (--add-bias-linear; megatron-core's MLA projections have no other bias)."""
    m = _mla(model)
    norms = 0
    if model.qk_layernorm:
        per = 2 if model.normalization == "LayerNorm" else 1
        norms = per * (m.kv_lora_rank + (m.q_lora_rank or 0))
    bias = model.hidden_size if model.add_bias_linear else 0
    return attention_matmul_params(model) + norms + bias


def attention_dim(model: ModelSpec) -> float:
    """The `q` of the dense attention FLOP formulas (2 b s^2 q causal): QK^T runs over the query
    head width d_q and AV over d_v, so q = n (d_q + d_v) / 2."""
    m = _mla(model)
    return model.num_attention_heads * (m.q_head_dim() + m.v_head_dim) / 2


def gemms(model: ModelSpec, tp: ArrayLike) -> list[tuple[ArrayLike, ArrayLike]]:
    """(k, n) of the attention GEMMs on one GPU (module docstring for the TP split)."""
    m, h, n = _mla(model), model.hidden_size, model.num_attention_heads
    out: list[tuple[ArrayLike, ArrayLike]]
    if m.q_lora_rank is None:
        out = [(h, n * m.q_head_dim() / tp)]
    else:
        out = [(h, m.q_lora_rank / tp), (m.q_lora_rank, n * m.q_head_dim() / tp)]
    return out + [
        (h, (m.kv_lora_rank + m.qk_pos_emb_head_dim) / tp),
        (m.kv_lora_rank, n * (m.qk_head_dim + m.v_head_dim) / tp),
        (n * m.v_head_dim / tp, h),
    ]


def rope_elements(model: ModelSpec, tokens: ArrayLike, tp: ArrayLike) -> ArrayLike:
    """Elements RoPE reads and writes per forward: the query's d_rope part per head and the one
    shared key part (2 passes), plus the latent norms' input and output (2 passes)."""
    m, n = _mla(model), model.num_attention_heads
    rope = 2.0 * tokens * (n * m.qk_pos_emb_head_dim / tp + m.qk_pos_emb_head_dim)
    norms = 2.0 * tokens * (m.kv_lora_rank + (m.q_lora_rank or 0)) if model.qk_layernorm else 0.0
    return rope + norms


def saved_widths(model: ModelSpec) -> tuple[float, float]:
    """(split by tp, split by tp only under SP) elements per token one MLA layer keeps for
    backward besides the hidden-size tensors the dense formula counts: core attention's q, k
    (n d_q each) and v (n d_v), its output feeding linear_proj (n d_v); the latents (r_q, r_kv)
    as the up projections' inputs, and again as the latent norms' inputs with --qk-layernorm."""
    m, n = _mla(model), model.num_attention_heads
    sharded = n * (2.0 * m.q_head_dim() + 2.0 * m.v_head_dim)
    latent = float(m.kv_lora_rank + (m.q_lora_rank or 0))
    return sharded, latent * (2.0 if model.qk_layernorm else 1.0)


def kv_width(model: ModelSpec) -> float:
    """Per-token width of the K and V blocks a context-parallel ring passes, averaged over the
    two (k: n d_q, v: n d_v), i.e. the `kv` of the dense 2 * kv formula."""
    return attention_dim(model)
