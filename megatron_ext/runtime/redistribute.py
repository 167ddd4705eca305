"""Re-layout of activations between adjacent layers of different strategies, with its backward.

Legend: s = sequence, b = micro-batch (all replicas), h = hidden (any trailing dims);
S = ranks of the stage; a layout's local block is `[s_loc, b_loc, h]`, e.g. `[s/tp, b/dp, h]`
under sp, `[s/cp, b/dp, h]` (chunks i and 2cp-1-i) under cp, `[s/ulysses, b/dp, h]` for Ulysses.

One exchange covers every pair of layouts (TP <-> SP, TP degree changes, DP <-> TP "relocation",
CP / Ulysses <-> anything, batch <-> sequence splits): both layouts are compared on the finest
common grid of sequence chunks and batch slices; a rank takes what it already holds locally and
receives the rest in one `all_to_all_single` over the stage group, from the replica whose tp rank
matches its own (spreading the load over replicas). Exchanges where every rank already holds
what it needs (e.g. `tp2 dp2 -> tp1 dp4`, the forward of Galvatron's TP->DP relocation) move no
data between ranks.

Gradient convention (Megatron's): a replicated activation carries the full gradient on every
replica. The backward of `src -> dst` is therefore the exchange `dst -> src` on the gradient.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.geometry.activation import ActivationLayout, common_granularity

__all__ = ["ExchangePlan", "exchange_plan", "local_block", "local_tokens", "redistribute"]

Runs = tuple[tuple[int, int], ...]
"""Half-open token ranges along dim 0 of a local block, in exchange order."""


@dataclass(frozen=True, slots=True)
class _Piece:
    peer: int
    """Local rank on the other side (this rank itself for local copies)."""
    src_runs: Runs
    src_batch: tuple[int, int]
    dst_runs: Runs
    dst_batch: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        return sum(b - a for a, b in self.src_runs)


@dataclass(frozen=True, slots=True)
class ExchangePlan:
    """What one rank copies, sends and receives to go from `src` to `dst`."""

    out_shape: tuple[int, int]
    """(s_loc, b_loc) of the dst block."""
    local: tuple[_Piece, ...]
    sends: tuple[_Piece, ...]
    """Ordered by peer; runs index the src block."""
    recvs: tuple[_Piece, ...]
    """Ordered by peer; runs index the dst block."""
    needs_comm: bool
    """True when any rank of the stage receives remote data (then all ranks join the a2a)."""
    is_identity: bool
    """True when every rank's dst block equals its src block (nothing to do)."""


def _runs(local_chunks: list[int], chunk_size: int) -> Runs:
    """Token runs of local chunk indices, merging neighbours."""
    runs: list[list[int]] = []
    for c in local_chunks:
        a, b = c * chunk_size, (c + 1) * chunk_size
        if runs and runs[-1][1] == a:
            runs[-1][1] = b
        else:
            runs.append([a, b])
    return tuple((a, b) for a, b in runs)


@functools.lru_cache(maxsize=1024)
def exchange_plan(src: ActivationLayout, dst: ActivationLayout, seq_length: int, batch: int,
                  rank: int) -> ExchangePlan:
    """Exchange plan of local `rank` for a `[seq_length, batch, ...]` activation (all ranks
    agree)."""
    assert src.width == dst.width, (src, dst)
    width = src.width
    grain = common_granularity(src, dst)
    assert seq_length % grain == 0 and batch % src.dp == 0 and batch % dst.dp == 0
    chunk = seq_length // grain
    held = [src.chunk_ids(r, grain) for r in range(width)]
    need = [dst.chunk_ids(r, grain) for r in range(width)]
    held_b = [src.batch_range(r, batch) for r in range(width)]
    need_b = [dst.batch_range(r, batch) for r in range(width)]

    def piece(s: int, d: int, peer: int) -> _Piece | None:
        lo, hi = max(held_b[s][0], need_b[d][0]), min(held_b[s][1], need_b[d][1])
        have = {c: i for i, c in enumerate(held[s])}
        common = [(have[c], j) for j, c in enumerate(need[d]) if c in have]
        if lo >= hi or not common:
            return None
        return _Piece(
            peer=peer,
            src_runs=_runs([i for i, _ in common], chunk),
            src_batch=(lo - held_b[s][0], hi - held_b[s][0]),
            dst_runs=_runs([j for _, j in common], chunk),
            dst_batch=(lo - need_b[d][0], hi - need_b[d][0]),
        )

    def source(d: int, block: tuple[int, ...]) -> int:
        return d if d in block else block[d % len(block)]

    blocks = sorted({src.replicas(r) for r in range(width)})
    local, recvs, sends = [], [], []
    needs_comm = False
    for d in range(width):
        for block in blocks:
            s = source(d, block)
            if s == d:
                continue
            p = piece(s, d, peer=s)
            needs_comm = needs_comm or p is not None
            if p is not None and d == rank:
                recvs.append(p)
            if p is not None and s == rank:
                sends.append(_Piece(peer=d, src_runs=p.src_runs, src_batch=p.src_batch,
                                    dst_runs=p.dst_runs, dst_batch=p.dst_batch))
    own = piece(rank, rank, peer=rank)
    local = [own] if own is not None else []
    out_shape = dst.local_shape(seq_length, batch)
    identity = all(held[r] == need[r] and held_b[r] == need_b[r] for r in range(width))
    return ExchangePlan(out_shape=out_shape, local=tuple(local), sends=tuple(sends),
                        recvs=tuple(recvs), needs_comm=needs_comm, is_identity=identity)


def _take(x: torch.Tensor, runs: Runs, batch: tuple[int, int]) -> torch.Tensor:
    parts = [x[a:b, batch[0]:batch[1]] for a, b in runs]  # [n, b_piece, h] each
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _put(out: torch.Tensor, piece: torch.Tensor, runs: Runs, batch: tuple[int, int]) -> None:
    offset = 0
    for a, b in runs:
        out[a:b, batch[0]:batch[1]] = piece[offset:offset + b - a]
        offset += b - a


def _exchange(x: torch.Tensor, plan: ExchangePlan, group: dist.ProcessGroup) -> torch.Tensor:
    """[s_src, b_src, h] -> [s_dst, b_dst, h] following `plan` (collective when needs_comm)."""
    rest = x.shape[2:]
    out = x.new_empty((*plan.out_shape, *rest))  # [s_dst, b_dst, h]
    for p in plan.local:
        _put(out, _take(x, p.src_runs, p.src_batch), p.dst_runs, p.dst_batch)
    if not plan.needs_comm:
        return out
    width = dist.get_world_size(group)
    per_token = rest.numel()
    send_splits, recv_splits = [0] * width, [0] * width
    for p in plan.sends:
        send_splits[p.peer] = p.num_tokens * (p.src_batch[1] - p.src_batch[0]) * per_token
    for p in plan.recvs:
        recv_splits[p.peer] = p.num_tokens * (p.dst_batch[1] - p.dst_batch[0]) * per_token
    pieces = [_take(x, p.src_runs, p.src_batch).reshape(-1) for p in plan.sends]
    send = torch.cat(pieces) if pieces else x.new_empty(0)  # [sum(send_splits)]
    recv = x.new_empty(sum(recv_splits))  # [sum(recv_splits)]
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    offset = 0
    for p in plan.recvs:
        shape = (p.num_tokens, p.dst_batch[1] - p.dst_batch[0], *rest)  # [n, b_piece, h]
        size = recv_splits[p.peer]
        _put(out, recv[offset:offset + size].view(shape), p.dst_runs, p.dst_batch)
        offset += size
    return out


class _Redistribute(torch.autograd.Function):
    """Forward: exchange src -> dst. Backward: exchange dst -> src of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src: ActivationLayout,  # type: ignore[override]
                dst: ActivationLayout, group: dist.ProcessGroup, seq_length: int, batch: int,
                rank: int) -> torch.Tensor:
        ctx.args = (src, dst, group, seq_length, batch, rank)
        return _exchange(x, exchange_plan(src, dst, seq_length, batch, rank), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        src, dst, group, seq_length, batch, rank = ctx.args
        plan = exchange_plan(dst, src, seq_length, batch, rank)
        return _exchange(grad.contiguous(), plan, group), None, None, None, None, None, None


def redistribute(
    x: torch.Tensor, src: ActivationLayout, dst: ActivationLayout, *, group: dist.ProcessGroup
) -> torch.Tensor:
    """Local block of `src` (`[s_loc, b_loc, h]`) -> local block of `dst`, differentiably.

    `group` spans the stage's ranks in local-rank order. Collective over `group` whenever any
    rank needs remote data, so all its ranks must call it with the same layouts.
    """
    if src == dst:
        return x
    seq_length = x.shape[0] * src.cp * src.ulysses * (src.tp if src.sp else 1)
    batch = x.shape[1] * src.dp
    rank = dist.get_rank(group)
    if exchange_plan(src, dst, seq_length, batch, rank).is_identity:
        return x
    return _Redistribute.apply(x, src, dst, group, seq_length, batch, rank)


def local_block(full: torch.Tensor, layout: ActivationLayout, rank: int) -> torch.Tensor:
    """`[s, b, h]` full activation -> this rank's `[s_loc, b_loc, h]` block (a copy)."""
    positions = torch.tensor(layout.positions(rank, full.shape[0]), device=full.device)
    lo, hi = layout.batch_range(rank, full.shape[1])
    return full.index_select(0, positions)[:, lo:hi].contiguous()  # [s_loc, b_loc, h]


def local_tokens(tokens: torch.Tensor, layout: ActivationLayout, rank: int,
                 shard: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Batch-first `[b, s]` token ids (or masks) -> this rank's `[b_loc, s_loc]` part.

    `shard = (index, count)`: `tokens` holds only rows [index*b/count, (index+1)*b/count) of the
    micro-batch (the part this rank read); its block must lie inside them."""
    index, count = shard
    if count == 1:
        return local_block(tokens.transpose(0, 1), layout, rank).transpose(0, 1).contiguous()
    rows = tokens.shape[0]  # b/count
    lo, hi = layout.batch_range(rank, rows * count)
    lo, hi = lo - index * rows, hi - index * rows
    assert 0 <= lo and hi <= rows, (shard, layout, rank)
    positions = torch.tensor(layout.positions(rank, tokens.shape[1]), device=tokens.device)
    return tokens[lo:hi].index_select(1, positions).contiguous()  # [b_loc, s_loc]
