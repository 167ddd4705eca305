"""Memory cost: model states per ZeRO level and activations per layer (Korthikanti et al. 2022).

Legend: b = samples per data-parallel replica, s = sequence length, sl = s / (cp * ulysses)
tokens of the sequence on one GPU, rows = b * sl, h = hidden, q = heads * head_dim,
kv = query_groups * head_dim, f = ffn hidden, a = heads, t = tp, d = ranks sharing one
parameter shard's gradients (dp * cp * ulysses), e = bytes per activation element.
Functions are vectorised over numpy arrays of strategies.

Activation bytes of one layer and one micro-batch ("Reducing Activation Recomputation in Large
Transformer Models", eq. 1-2, generalised to GQA and swiglu, with flash attention optional):
  kept unsharded by TP, sharded by SP:  4 [rows, h] tensors (norm 1 input, QKV input, norm 2
      input, MLP input) + 2 dropout masks of [rows, h] bytes
  sharded by TP:  Q, K, V [rows, q + 2kv] + projection input [rows, q] + activation input
      [rows, f or 2f (swiglu)] + second MLP GEMM input [rows, f]
  core attention:  flash, CP or Ulysses (blockwise): fp32 log-sum-exp [rows, a/t]; otherwise
      scores, softmax and dropout mask (2e + 1) * a/t * rows * s/cp
With full recomputation only the layer input [rows, h] (/t under SP) is kept; selective
recomputation drops the core-attention term. Korthikanti's GPT case (f = 4h, kv = q = h, no
flash, e = 2) gives sbh(10 + 24/t + 5as/(ht)) without SP and sbh(34/t + 5as/(ht)) with it.

That formula is for fused kernels (Transformer Engine, Megatron's fused softmax / bias-dropout).
The unfused local layers (this package's CPU runtime, and any run without Transformer Engine)
keep more; `unfused_activation_bytes` is that difference, term by term, as autograd's saved
tensors show it (tools/bench_memory.py lists them; d = head_dim):
  norms         each of the 2 RMSNorms keeps its normalised output [rows, h] (e) and its fp32
                inverse RMS [rows] (4 bytes), /t under SP
  SwiGLU        the gate's activation and the gated product: 2 more [rows, f], /t
  Q, K, V       the rotated Q and K are copies, V a view of the QKV output that pins all of it:
                (q + kv) more per row, /t; except without recompute under grouped-query
                attention, where K and V are expanded (copied) from the query groups to the
                heads for the batched matmuls and nothing pins the QKV output: 2 (q - kv) more
  RoPE          the cos / sin tables of Q and K, 4 x [sl, d] fp32 per layer (full recompute: the
                rotary table is a checkpoint input, 1 x [sl, d]); Ulysses rotates its own
                sequence chunk before the all-to-all, so sl = s / (cp u)
  dropout       every mask is the multiplied fp32 noise (e bytes, not 1): (e - 1) more per
                element of the 2 hidden masks, and of the attention mask without recompute
                (none under CP / Ulysses: the blockwise attention keeps no scores)
"""

from __future__ import annotations

import numpy as np

from megatron_ext.planner.cost import mla
from megatron_ext.planner.cost.compute import kv_dim, q_dim
from megatron_ext.specs import ModelSpec

ArrayLike = float | np.ndarray
RECOMPUTE_CODES = {"none": 0, "selective": 1, "full": 2}


def state_bytes_per_param(
    zero: ArrayLike, shard_ranks: ArrayLike, *, half_precision: bool, num_optimizer_states: int = 2,
    half_grads: bool = False,
) -> ArrayLike:
    """Bytes per parameter of weights, gradients and optimizer states on one GPU.

    ZeRO-0/1 (Megatron DDP / distributed optimizer), mixed precision: half weight 2 + fp32 main
    grad 4 + fp32 master 4 + 4 per optimizer state; ZeRO-1 shards master + states over d. fp32:
    weight 4 + grad 4 + 4 per state; ZeRO-1 shards the states only (no separate master copy).
    ZeRO-2/3 (FSDP2, megatron_adapter/fsdp.py): fp32 weight shards that are the master copy,
    fp32 gradient shards and the states, all over d: (4 + 4 + states) / d; ZeRO-2 also holds
    the layer's weights gathered (at the compute precision) from its forward to its backward.
    `half_grads` (DeepSpeed's BF16_Optimizer, TrainingSpec.keeps_half_grads): ZeRO-0/1 also keep
    every parameter's half-precision .grad (2) beside the full fp32 gradient.
    """
    zero = np.asarray(zero)
    d = np.asarray(shard_ranks, dtype=float)
    states = 4.0 * num_optimizer_states
    weight = 2.0 if half_precision else 4.0
    if half_precision:
        kept, sharded = 2.0 + 4.0, 4.0 + states
    else:
        kept, sharded = 8.0, states
    fsdp = (4.0 + 4.0 + states) / d
    if half_grads and half_precision:
        kept += 2.0
    out = np.where(zero == 0, kept + sharded, np.where(
        zero == 1, kept + sharded / d, np.where(zero == 2, weight + fsdp, fsdp)))
    return float(out) if out.ndim == 0 else out


def state_bytes_breakdown(
    zero: ArrayLike, shard_ranks: ArrayLike, *, half_precision: bool, num_optimizer_states: int = 2,
    half_grads: bool = False,
) -> tuple[ArrayLike, ArrayLike, ArrayLike]:
    """`state_bytes_per_param` split into (weights, gradients, optimizer states) bytes per
    parameter; they always sum to it (tests/unit/test_evaluate_command.py). ZeRO-0/1: the
    optimizer part holds the fp32 master copy (mixed precision) and the states. ZeRO-2/3: the
    fp32 weight shard is the master copy and counts as weights (ZeRO-2 adds the gathered
    compute-precision copy), the optimizer part is the states."""
    zero = np.asarray(zero)
    d = np.asarray(shard_ranks, dtype=float)
    states = 4.0 * num_optimizer_states
    weight = 2.0 if half_precision else 4.0
    master = 4.0 if half_precision else 0.0
    weights = np.where(zero <= 1, weight, np.where(zero == 2, weight + 4.0 / d, 4.0 / d))
    grads = np.where(zero <= 1, 4.0 + (2.0 if half_grads and half_precision else 0.0), 4.0 / d)
    optim = np.where(zero == 0, master + states, np.where(zero == 1, (master + states) / d,
                                                          states / d))
    if weights.ndim == 0:
        return float(weights), float(grads), float(optim)
    return weights, grads, optim


def layer_activation_bytes(
    model: ModelSpec,
    *,
    b: ArrayLike,
    seq_length: int,
    tp: ArrayLike,
    sp: ArrayLike,
    cp: ArrayLike,
    ulysses: ArrayLike,
    recompute: ArrayLike,
    element_bytes: int,
    flash_attention: bool = True,
    dropout: bool = True,
) -> ArrayLike:
    """Bytes one layer keeps for its backward, per in-flight micro-batch, on one GPU.
    `recompute` is 0 none, 1 selective, 2 full (RECOMPUTE_CODES)."""
    e = element_bytes
    h, f = model.hidden_size, model.ffn_hidden_size
    rows = b * seq_length / (cp * ulysses)
    sp_div = np.where(sp, tp, 1)
    masks = 2.0 * rows * h if dropout else 0.0
    unsharded = (4.0 * e * rows * h + masks) / sp_div
    mlp_in = f * (2 if model.activation == "swiglu" else 1) + f
    sharded = e * rows * (q_dim(model) + 2 * kv_dim(model) + q_dim(model) + mlp_in) / tp
    if model.mla is not None:  # q, k, v, attention output and the latents (cost/mla.py)
        attention, latent = mla.saved_widths(model)
        sharded = e * rows * (attention + mlp_in) / tp
        unsharded = unsharded + e * rows * latent / sp_div
    core = core_attention_bytes(
        model,
        rows=rows,
        seq_length=seq_length,
        tp=tp,
        cp=cp,
        ulysses=ulysses,
        element_bytes=e,
        flash_attention=flash_attention,
        dropout=dropout,
    )
    recompute = np.asarray(recompute)
    full = e * rows * h / sp_div
    out = np.where(recompute == 2, full, unsharded + sharded + np.where(recompute == 1, 0.0, core))
    return float(out) if np.ndim(out) == 0 else out


def unfused_activation_bytes(
    model: ModelSpec,
    *,
    b: ArrayLike,
    seq_length: int,
    tp: ArrayLike,
    sp: ArrayLike,
    cp: ArrayLike,
    ulysses: ArrayLike,
    recompute: ArrayLike,
    element_bytes: int,
    dropout: bool = True,
) -> ArrayLike:
    """What the unfused local layers keep beyond `layer_activation_bytes` (module docstring),
    per layer and in-flight micro-batch on one GPU; add it to that formula's no-flash value.
    `recompute` is 0 none, 1 selective, 2 full."""
    e = element_bytes
    h, f = model.hidden_size, model.ffn_hidden_size
    tp = np.asarray(tp)
    rows = b * seq_length / (np.asarray(cp) * np.asarray(ulysses))
    sp_div = np.where(sp, tp, 1)
    d = q_dim(model) // model.num_attention_heads
    seq_shards = np.asarray(cp) * np.asarray(ulysses)
    rope_rows = seq_length / seq_shards if model.position_embedding == "rope" else 0.0
    norms = 2.0 * rows * (e * h + 4) / sp_div
    swiglu = 2.0 * e * rows * f / tp if model.activation == "swiglu" else 0.0
    q, kv = q_dim(model), kv_dim(model)
    masks = 2.0 * (e - 1) * rows * h / sp_div if dropout else 0.0
    scores = model.num_attention_heads / tp * rows * seq_length / np.asarray(cp)
    attention_mask = np.where(seq_shards > 1, 0.0, (e - 1) * scores) if dropout else 0.0
    pinned = e * rows * (q + kv) / tp  # rotated Q and K copies + the QKV output V pins
    expanded = 2.0 * e * rows * (q - kv) / tp  # GQA: K and V copied out to the heads
    rope = 4.0 * rope_rows * d * 4
    none = norms + swiglu + masks + (expanded if kv < q else pinned) + rope + attention_mask
    selective = norms + swiglu + masks + pinned + rope
    full = 1.0 * rope_rows * d * 4
    recompute = np.asarray(recompute)
    out = np.where(recompute == 2, full, np.where(recompute == 1, selective, none))
    if model.mla is not None:
        # full recompute keeps the layer input alone: MLA builds its rotary table inside the
        # attention, so no table is a checkpoint input
        out = np.where(recompute == 2, 0.0,
                       norms + swiglu + masks + _mla_unfused_bytes(model, rows, rope_rows, sp_div,
                                                                   e))
    return float(out) if np.ndim(out) == 0 else out


def _mla_unfused_bytes(model: ModelSpec, rows: ArrayLike, rope_rows: ArrayLike,
                       sp_div: ArrayLike, e: int) -> ArrayLike:
    """MLA's part of the unfused term (tools/bench_memory.py, two MLA shapes, exact without SP):
    each latent RMSNorm (--qk-layernorm) keeps its normalised output and fp32 inverse RMS beyond
    the input and output the fused formula counts; the KV down-projection's RoPE columns stay
    alive through the latent's view of that output; RoPE's four cos / sin tables are
    [sl, d_rope] fp32."""
    mla = model.mla
    assert mla is not None
    latent_norms: ArrayLike = 0.0
    if model.qk_layernorm:
        norms = 2 if mla.q_lora_rank else 1
        latent_norms = rows * (e * ((mla.q_lora_rank or 0) + mla.kv_lora_rank) + 4 * norms)
    pinned = e * rows * mla.qk_pos_emb_head_dim
    return (latent_norms + pinned) / sp_div + 4.0 * rope_rows * mla.qk_pos_emb_head_dim * 4


def core_attention_bytes(
    model: ModelSpec,
    *,
    rows: ArrayLike,
    seq_length: int,
    tp: ArrayLike,
    cp: ArrayLike,
    element_bytes: int,
    flash_attention: bool,
    dropout: bool,
    ulysses: ArrayLike = 1,
) -> ArrayLike:
    """What core attention keeps: fp32 log-sum-exp with flash attention, and under context
    parallelism or Ulysses whatever the flag (blockwise attention: Transformer Engine's, which
    Megatron-LM's CP requires, or this package's runtime/ring_attention.py, which saves q, k,
    v, its output and the log-sum-exp); otherwise the [a/t, rows, s/cp] scores, softmax output
    and dropout mask."""
    a = model.num_attention_heads
    lse = 4.0 * rows * a / tp
    if flash_attention:
        return lse
    per_score = 2 * element_bytes + 1 if dropout else element_bytes
    scores = per_score * a / tp * rows * seq_length / cp
    return np.where(np.asarray(cp) * np.asarray(ulysses) > 1, lse, scores)


def layer_transient_bytes(
    act_none: ArrayLike,
    act_kept: ArrayLike,
    *,
    zero: ArrayLike,
    params_per_gpu: ArrayLike,
    element_bytes: int,
    zero3_live_params: float | None = None,
) -> ArrayLike:
    """Short-lived memory while one layer runs its backward: the activations recomputation
    rebuilds (act_none - act_kept), plus under ZeRO-3 two gathered copies of the layer's
    weights (the running layer and the prefetched next one, as FSDP2 wraps each layer), or at
    most `zero3_live_params` gathered parameters where the implementation caps them (DeepSpeed
    ZeRO-3 gathers module by module up to stage3_max_live_parameters)."""
    live = 2.0 * np.asarray(params_per_gpu, dtype=float)
    if zero3_live_params is not None:
        live = np.minimum(live, zero3_live_params)
    gathered = np.where(np.asarray(zero) == 3, live * element_bytes, 0.0)
    return (act_none - act_kept) + gathered
