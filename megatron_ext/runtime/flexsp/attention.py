"""Packed variable-length causal attention, and its Ulysses form for one FlexSP group.

Legend: T = packed tokens of several sequences (cu_seqlens marks their boundaries), t = this
rank's share of them, n = query heads, g = kv heads, d = head dim, u = Ulysses group size.

`varlen_attention` uses flash-attn's `flash_attn_varlen_func` when it is importable and the
tensors are on CUDA in fp16/bf16; otherwise a pure-torch path runs
`scaled_dot_product_attention` once per sequence (causal inside the sequence, nothing across
sequences; GQA via `enable_gqa`), which works on CPU in fp32/fp64 and is what the tests check.
megatron-core's local DotProductAttention rejects packed input, hence this module.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext.runtime.flexsp.ulysses import (
    check_ulysses_degree,
    heads_to_seq,
    kv_repeat_factor,
    seq_to_heads,
)

__all__ = ["flash_attn_available", "ulysses_varlen_attention", "varlen_attention"]

try:  # optional GPU kernel
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except ImportError:  # pragma: no cover - depends on the environment
    _flash_varlen = None


def flash_attn_available() -> bool:
    return _flash_varlen is not None


def varlen_attention(
    q: torch.Tensor,  # [T, n, d]
    k: torch.Tensor,  # [T, g, d]
    v: torch.Tensor,  # [T, g, d]
    cu_seqlens: list[int],
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:  # [T, n, d]
    """Attention of each packed sequence with itself; n must be a multiple of g."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if (_flash_varlen is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=q.device)
        max_len = max(b - a for a, b in itertools.pairwise(cu_seqlens))
        return _flash_varlen(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale,
                             causal=causal)
    out = torch.empty_like(q)  # [T, n, d]
    for start, end in itertools.pairwise(cu_seqlens):
        if end == start:
            continue
        qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, n, s, d]
        ks = k[start:end].transpose(0, 1).unsqueeze(0)  # [1, g, s, d]
        vs = v[start:end].transpose(0, 1).unsqueeze(0)  # [1, g, s, d]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale,
                                           enable_gqa=ks.shape[1] != qs.shape[1])
        out[start:end] = o.squeeze(0).transpose(0, 1)  # [s, n, d]
    return out


def ulysses_varlen_attention(
    q: torch.Tensor,  # [t, n, d]
    k: torch.Tensor,  # [t, g, d]
    v: torch.Tensor,  # [t, g, d]
    *,
    group: dist.ProcessGroup | None,
    token_counts: list[int],
    cu_seqlens: list[int],
    softmax_scale: float | None = None,
) -> torch.Tensor:  # [t, n, d]
    """Causal attention of the group's packed sequences for this rank's tokens.

    `token_counts[i]`: tokens group rank i holds; `cu_seqlens`: boundaries of the sequences in
    the group's packed stream (its last entry is sum(token_counts)).
    """
    degree = len(token_counts)
    assert cu_seqlens[-1] == sum(token_counts), "cu_seqlens must cover the group's tokens"
    check_ulysses_degree(q.shape[1], k.shape[1], degree)
    repeat = kv_repeat_factor(k.shape[1], degree)
    if repeat > 1:
        k = k.repeat_interleave(repeat, dim=1)  # [t, u, d]: one kv head per rank
        v = v.repeat_interleave(repeat, dim=1)  # [t, u, d]
    q_all = seq_to_heads(q, group, token_counts)  # [T, n/u, d]
    k_all = seq_to_heads(k, group, token_counts)  # [T, g/u or 1, d]
    v_all = seq_to_heads(v, group, token_counts)  # [T, g/u or 1, d]
    out = varlen_attention(q_all, k_all, v_all, cu_seqlens, softmax_scale=softmax_scale)
    return heads_to_seq(out, group, token_counts)  # [t, n, d]
