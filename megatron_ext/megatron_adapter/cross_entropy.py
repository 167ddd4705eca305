"""Vocabulary-parallel cross entropy over an explicit group.

Legend: s = sequence, b = micro-batch, v = padded vocabulary, tp = size of `group`.

megatron-core 0.16.1's `vocab_parallel_cross_entropy` (tensor_parallel/cross_entropy.py:219)
reads the global TP group; the output layer of a heterogeneous plan uses the vocabulary tp group
instead. Same algorithm, built from the same `VocabParallelCrossEntropy` static helpers; only
the group is a parameter (upstream HEAD added `tp_group=`, which retires this file).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.utils import VocabUtility

__all__ = ["group_vocab_parallel_cross_entropy"]


class _GroupVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor,  # type: ignore[override]
                group: dist.ProcessGroup) -> torch.Tensor:
        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(logits)  # [s, b, v/tp]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)  # [s, b]
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.size(-1), dist.get_rank(group), dist.get_world_size(group)
        )
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(
                logits, target, logits_max, start, end
            )
        )
        dist.all_reduce(predicted, group=group)  # [s, b]
        dist.all_reduce(sum_exp, group=group)  # [s, b]
        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(
            exp_logits, predicted, sum_exp
        )
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss  # [s, b]

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, update, grad_input = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask)
        )
        grad_input = VocabParallelCrossEntropy.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, update, grad_input, grad_output
        )
        return grad_input, None, None  # [s, b, v/tp]


def group_vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Per-token loss `[s, b]` of vocab-sharded `logits [s, b, v/tp]` against `target [s, b]`."""
    return _GroupVocabParallelCrossEntropy.apply(logits, target, group)
