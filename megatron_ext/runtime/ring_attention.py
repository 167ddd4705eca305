"""Causal ring attention over a context-parallel group, pure torch (Liu et al. 2023, "Ring
Attention with Blockwise Transformers"; Megatron/TE load-balanced "zigzag" chunking).

Legend: s = local sequence (two chunks i and 2*cp-1-i of the global sequence on cp rank i),
b = batch, n = query heads, g = key/value heads (GQA, n % g == 0), d = head dim, cp = ring size.

Forward: the key/value block travels around the ring; each step attends the local queries to the
visiting block with a causal mask built from global positions and merges the partial outputs
with their log-sum-exp (online softmax). Backward recomputes each block's probabilities from the
saved row log-sum-exp; dK/dV accumulators travel with their block and reach the owner after a
final hop. fp32 (or wider) math; cp = 1 degenerates to plain causal attention without communication.
Used by `megatron_adapter` as core attention on CPU; with Transformer Engine, TE's CP attention
is used instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ring_attention", "zigzag_positions"]


def zigzag_positions(cp_rank: int, cp: int, s_local: int, device: torch.device) -> torch.Tensor:
    """Global positions `[s_local]` of the load-balanced chunks held by `cp_rank`."""
    if cp == 1:
        return torch.arange(s_local, device=device)
    half = s_local // 2
    first = torch.arange(cp_rank * half, (cp_rank + 1) * half, device=device)
    last = torch.arange((2 * cp - 1 - cp_rank) * half, (2 * cp - cp_rank) * half, device=device)
    return torch.cat([first, last])  # [s_local]


def _ring_exchange(send: torch.Tensor, group: dist.ProcessGroup) -> list[dist.Work] | torch.Tensor:
    """Start sending `send` to the next cp rank and receiving the previous rank's into a buffer."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % size), group),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % size), group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return recv


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """[s, b, g, d] -> [b, n, s, d] with each kv head repeated for its n/g query heads."""
    return kv.permute(1, 2, 0, 3).repeat_interleave(heads // kv.shape[2], dim=1)


def _scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
            scale: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, n, sq, sk]
    return scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Accumulation precision: fp32, or the input's if wider (fp64 parity tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                group: dist.ProcessGroup, scale: float) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        s, _, n, _ = q.shape
        qh = _acc(q).permute(1, 2, 0, 3)  # [b, n, s, d]
        q_pos = zigzag_positions(rank, cp, s, q.device)
        out = torch.zeros_like(qh)  # [b, n, s, d]
        lse = torch.full(qh.shape[:3], float("-inf"), dtype=qh.dtype, device=q.device)  # [b, n, s]
        kv = _acc(torch.cat([k, v], dim=2))  # [s, b, 2g, d]
        for step in range(cp):
            owner = (rank - step) % cp
            k_blk, v_blk = kv.chunk(2, dim=2)  # [s, b, g, d] each
            scores = _scores(qh, _expand(k_blk, n), q_pos, zigzag_positions(owner, cp, s, q.device),
                             scale)  # [b, n, s, s]
            blk_lse = torch.logsumexp(scores, dim=-1)  # [b, n, s]
            blk_out = torch.matmul(torch.exp(scores - _finite(blk_lse)[..., None]),
                                   _expand(v_blk, n))  # [b, n, s, d]
            new_lse = _finite(torch.logaddexp(lse, blk_lse))
            out = out * torch.exp(lse - new_lse)[..., None] + blk_out * torch.exp(
                blk_lse - new_lse)[..., None]
            lse = torch.logaddexp(lse, blk_lse)
            if step + 1 < cp:
                kv = _ring_exchange(kv, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out.permute(2, 0, 1, 3).to(q.dtype)  # [s, b, n, d]

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        s, b, n, _ = q.shape
        g = k.shape[2]
        qh = _acc(q).permute(1, 2, 0, 3)  # [b, n, s, d]
        do = _acc(dout).permute(1, 2, 0, 3)  # [b, n, s, d]
        delta = (do * out).sum(-1, keepdim=True)  # [b, n, s, 1]
        q_pos = zigzag_positions(rank, cp, s, q.device)
        dq = torch.zeros_like(qh)
        kv = _acc(torch.cat([k, v], dim=2))  # [s, b, 2g, d]
        dkv = torch.zeros_like(kv)  # gradient accumulator of the visiting block
        for step in range(cp):
            owner = (rank - step) % cp
            k_blk, v_blk = kv.chunk(2, dim=2)
            kh, vh = _expand(k_blk, n), _expand(v_blk, n)  # [b, n, s, d]
            scores = _scores(qh, kh, q_pos, zigzag_positions(owner, cp, s, q.device), scale)
            probs = torch.exp(scores - _finite(lse)[..., None])  # [b, n, s, s]
            dv = torch.matmul(probs.transpose(-1, -2), do)  # [b, n, s, d]
            dscores = probs * (torch.matmul(do, vh.transpose(-1, -2)) - delta)  # [b, n, s, s]
            dq += torch.matmul(dscores, kh) * scale
            dk = torch.matmul(dscores.transpose(-1, -2), qh) * scale  # [b, n, s, d]
            fold = (b, g, n // g, s, -1)
            dk = dk.reshape(fold).sum(2).permute(2, 0, 1, 3)  # [s, b, g, d]
            dv = dv.reshape(fold).sum(2).permute(2, 0, 1, 3)  # [s, b, g, d]
            dkv += torch.cat([dk, dv], dim=2)
            if step + 1 < cp:
                kv = _ring_exchange(kv, group)
            if cp > 1:  # after the last step this hop delivers each block's grads to its owner
                dkv = _ring_exchange(dkv, group)
        dk, dv = dkv.chunk(2, dim=2)
        dq = dq.permute(2, 0, 1, 3)  # [s, b, n, d]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   group: dist.ProcessGroup, softmax_scale: float) -> torch.Tensor:
    """Causal attention of local `q [s, b, n, d]` over the ring's `k, v [s, b, g, d]`.

    Returns `[s, b, n, d]`. Collective over `group` (every cp rank calls it); the local sequence
    holds the zigzag chunks of `zigzag_positions`.
    """
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group,
                                softmax_scale)
