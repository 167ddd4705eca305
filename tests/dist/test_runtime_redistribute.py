"""Every pair of activation layouts on 4 ranks (sampled 8-rank pairs run inside the 8-rank parity
spawn of test_runtime_parity.py): forward and backward of
`redistribute` against slicing a single global tensor; ring attention (cp), Ulysses and both
combined against single-process causal attention.

A re-layout only moves data, so its results must be bit-identical (no tolerance): any mismatch
is a wrong index, not rounding. Attention runs in fp64, where the only differences are the
order of the online-softmax merge: 1e-12 is ~1e4 ulp of headroom and far below any indexing or
masking bug (those are O(1)).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed as dist

from megatron_ext.geometry.activation import ActivationLayout
from megatron_ext.runtime.redistribute import exchange_plan, local_block, redistribute
from megatron_ext.runtime.ring_attention import ring_attention
from megatron_ext.runtime.testing import run_distributed
from megatron_ext.runtime.ulysses import heads_to_seq, seq_to_heads

pytestmark = pytest.mark.dist


def all_layouts(width: int) -> list[ActivationLayout]:
    found = []
    for tp, ulysses, cp in itertools.product(range(1, width + 1), repeat=3):
        if width % (tp * ulysses * cp) == 0:
            dp = width // (tp * ulysses * cp)
            for sp in (False, True) if tp > 1 else (False,):
                found.append(ActivationLayout(tp=tp, sp=sp, cp=cp, ulysses=ulysses, dp=dp))
    return found


def _check_pairs(rank: int, world_size: int, *, seq_length: int, batch: int,
                 max_pairs: int | None) -> int:
    group = dist.group.WORLD
    layouts = all_layouts(world_size)
    pairs = list(itertools.product(layouts, layouts))
    if max_pairs is not None:
        pairs = random.Random(0).sample(pairs, max_pairs)
    x_full = torch.randn(seq_length, batch, 3, dtype=torch.float64)  # [s, b, h]
    g_full = torch.randn(seq_length, batch, 3, dtype=torch.float64)  # dL/dy, [s, b, h]
    for src, dst in pairs:
        x = local_block(x_full, src, rank).requires_grad_()  # [s_src, b_src, h]
        y = redistribute(x, src, dst, group=group)  # [s_dst, b_dst, h]
        assert torch.equal(y, local_block(x_full, dst, rank)), (src, dst)
        y.backward(local_block(g_full, dst, rank))
        assert torch.equal(x.grad, local_block(g_full, src, rank)), ("grad", src, dst)
    return len(pairs)


def reference_attention(q, k, v, scale):  # [s, b, n, d], [s, b, g, d] -> [s, b, n, d]
    rep = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    scores = qh @ kh.transpose(-1, -2) * scale  # [b, n, s, s]
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)
    return (scores.masked_fill(causal, float("-inf")).softmax(-1) @ vh).permute(2, 0, 1, 3)


def _check_attention(rank: int, layout: ActivationLayout, ulysses_group, cp_group) -> None:
    """Ulysses over `ulysses_group` around ring attention over `cp_group`, as in a layer."""
    s, b, n, g, d, scale = 16, 2, 4, 2, 3, 0.37
    q, k, v = (torch.randn(s, b, h, d, dtype=torch.float64, requires_grad=True)
               for h in (n, g, g))
    out = reference_attention(q, k, v, scale)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    local = [local_block(t.detach(), layout, rank).requires_grad_() for t in (q, k, v)]
    heads = [seq_to_heads(t, ulysses_group) for t in local]  # [s/cp, b, heads/ulysses, d]
    mine = heads_to_seq(ring_attention(*heads, group=cp_group, softmax_scale=scale), ulysses_group)
    tol = {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(mine, local_block(out.detach(), layout, rank), **tol)
    mine.backward(local_block(grad_out, layout, rank))
    for t, ref in zip(local, grads):
        torch.testing.assert_close(t.grad, local_block(ref, layout, rank), **tol)


def _check_ops(rank: int, world_size: int, **kwargs) -> int:
    count = _check_pairs(rank, world_size, **kwargs)
    world = dist.group.WORLD
    pairs = [dist.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]
    single = [dist.new_group([r]) for r in range(world_size)][rank]
    _check_attention(rank, ActivationLayout(cp=4), single, world)
    _check_attention(rank, ActivationLayout(ulysses=2, dp=2), pairs[rank // 2], single)
    _check_attention(rank, ActivationLayout(ulysses=2, cp=2), pairs[rank // 2], pairs[2 + rank % 2])
    return count


def test_every_layout_pair_and_attention_on_4_ranks() -> None:
    counts = run_distributed(_check_ops, world_size=4, timeout_s=240, seq_length=16, batch=4,
                             max_pairs=None)
    assert counts[0] == len(all_layouts(4)) ** 2 == 14 * 14


def test_tp_to_dp_relocation_moves_no_data_forward() -> None:
    """Galvatron's TP->DP relocation: every rank already holds its new slice (§1.5 pattern)."""
    for rank in range(4):
        plan = exchange_plan(ActivationLayout(tp=2, dp=2), ActivationLayout(dp=4), 16, 4, rank)
        assert not plan.needs_comm and not plan.sends and len(plan.local) == 1
        back = exchange_plan(ActivationLayout(dp=4), ActivationLayout(tp=2, dp=2), 16, 4, rank)
        assert back.needs_comm and [p.peer for p in back.recvs] == [rank ^ 1]
    same = exchange_plan(ActivationLayout(tp=2, sp=True, dp=2), ActivationLayout(ulysses=2, dp=2),
                         16, 4, 1)
    assert same.is_identity  # SP and a contiguous split hold the same tokens
