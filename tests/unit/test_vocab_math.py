"""Vocabulary-parallel math on simulated shards in one process, against torch autograd.

Every shard's S/T passes run here in turn; the collectives are replaced by their definition
(stack = all-gather, sum = all-reduce), so these tests check the algebra of
megatron_ext/runtime/vocab/{output_layer,input_layer}.py exactly; tests/dist checks the
distributed schedule end to end.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.geometry.vocab_partition import VocabPartition
from megatron_ext.runtime.vocab.input_layer import (
    accumulate_embedding_grad,
    embedding_forward_pass,
    flush_embedding_grad,
)
from megatron_ext.runtime.vocab.output_layer import (
    combine_stats,
    finish_fused_input_grad,
    output_forward_pass,
    output_weight_grad_pass,
    softmax_scale,
)

# fp64 throughout: the sharded and the reference computations reorder sums, nothing else,
# so agreement to 1e-10 means the algebra is right.
TOL = {"rtol": 1e-10, "atol": 1e-10}


def test_partition_pads_and_counts_valid_rows() -> None:
    part = VocabPartition.create(130, 4)
    assert (part.padded_vocab_size, part.shard_size) == (132, 33)
    assert [part.num_valid(k) for k in range(4)] == [33, 33, 33, 31]
    assert VocabPartition.create(130, 4, divisible_by=8).padded_vocab_size == 160
    tiny = VocabPartition.create(5, 4)  # shards of 2: the last one is all padding
    assert [tiny.num_valid(k) for k in range(4)] == [2, 2, 1, 0]
    with pytest.raises(ValueError, match="padded_vocab_size"):
        VocabPartition(vocab_size=10, num_shards=4, padded_vocab_size=10)


def _reference(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, g: torch.Tensor):
    """Unsharded loss, dL/dX and dL/dW for L = sum(g * per-token CE)."""
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    s, b, h = x.shape
    logits = x.reshape(s * b, h) @ w.t()  # [n, V]
    loss = F.cross_entropy(logits, labels.reshape(-1), reduction="none")  # [n]
    (loss * g).sum().backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("vocab_size,num_shards", [(37, 4), (5, 4), (48, 3), (11, 1)])
@pytest.mark.parametrize("fused", [True, False])
def test_output_layer_matches_autograd(vocab_size: int, num_shards: int, fused: bool) -> None:
    torch.manual_seed(0)
    s, b, h = 5, 3, 8
    part = VocabPartition.create(vocab_size, num_shards)
    w_full = torch.randn(part.padded_vocab_size, h, dtype=torch.float64)
    x = torch.randn(s, b, h, dtype=torch.float64) * 3  # large logits: the rescaling matters
    labels = torch.randint(0, vocab_size, (s, b))
    g = torch.rand(s * b, dtype=torch.float64) * (torch.rand(s * b) > 0.3)  # loss mask-like
    loss_ref, dx_ref, dw_ref = _reference(x, w_full[:vocab_size], labels, g)

    shards = [w_full[k * part.shard_size:(k + 1) * part.shard_size].clone().requires_grad_()
              for k in range(num_shards)]
    states, stats = zip(*[
        output_forward_pass(x, shards[k], labels, vocab_start=part.shard_start(k),
                            num_valid=part.num_valid(k), fuse_input_grad=fused)
        for k in range(num_shards)])
    token_stats = combine_stats(torch.stack(stats))  # all-gather
    torch.testing.assert_close(token_stats.loss, loss_ref, **TOL)
    alphas = [softmax_scale(state, token_stats) for state in states]
    if fused:  # 1 barrier: alpha*A - B summed over shards, times g
        dx = sum(finish_fused_input_grad(st, a) for st, a in zip(states, alphas)) * g[:, None]
    dx_parts = [output_weight_grad_pass(st, shards[k], alphas[k], g, compute_input_grad=not fused)
                for k, st in enumerate(states)]
    if not fused:  # 2 barriers: the T passes' G_k W_k, summed
        dx = sum(dx_parts)
    torch.testing.assert_close(dx.reshape(s, b, h), dx_ref, **TOL)
    dw = torch.cat([w.grad for w in shards])  # [V_pad, h]
    torch.testing.assert_close(dw[:vocab_size], dw_ref, **TOL)
    assert torch.count_nonzero(dw[vocab_size:]) == 0, "padded rows must get no gradient"


def test_input_embedding_matches_lookup() -> None:
    torch.manual_seed(0)
    part = VocabPartition.create(23, 4)
    w_full = torch.randn(part.padded_vocab_size, 6, dtype=torch.float64)
    tokens = torch.randint(0, 23, (7, 2))  # [s, b]
    grads = [torch.randn(7, 2, 6, dtype=torch.float64) for _ in range(2)]  # two micro-batches
    shards = [w_full[k * part.shard_size:(k + 1) * part.shard_size].clone().requires_grad_()
              for k in range(4)]
    looked_up = [embedding_forward_pass(tokens, shards[k], vocab_start=part.shard_start(k),
                                        num_valid=part.num_valid(k)) for k in range(4)]
    torch.testing.assert_close(sum(partial for partial, _ in looked_up), w_full[tokens], **TOL)
    for k, (_, lookup) in enumerate(looked_up):
        buffer = torch.zeros_like(shards[k])
        for grad in grads:
            accumulate_embedding_grad(buffer, lookup, grad)
        shards[k].grad = torch.ones_like(shards[k])  # flushing accumulates, like autograd
        flush_embedding_grad(shards[k], buffer)
    ref = torch.zeros_like(w_full)
    for grad in grads:
        ref.index_add_(0, tokens.reshape(-1), grad.reshape(-1, 6))
    torch.testing.assert_close(torch.cat([w.grad for w in shards]), ref + 1, **TOL)
