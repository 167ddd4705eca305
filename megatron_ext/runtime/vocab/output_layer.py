"""Output layer + softmax cross-entropy on one vocabulary shard (Yeung et al. 2025, sections 3-4).

Legend: s = sequence, b = micro-batch, n = s*b tokens (s-major), h = hidden, v = shard rows,
R = shards. Shard k holds W_k [v, h]; its logits are Y_k = X W_k^T.

S pass (`output_forward_pass`): local logits, local max m_k, local sum s_k = sum exp(Y_k - m_k),
target logit; with the fused input gradient (1-barrier algorithm) also A_k = P_k W_k and
B_k = W_k[y] (P_k = exp(Y_k - m_k) / s_k). Stats reduction (`combine_stats`): global max M,
Z = sum_k s_k exp(m_k - M), loss = log Z + M - logit_y (the online-softmax rescaling).
Softmax slice = alpha_k * P_k with alpha_k = s_k exp(m_k - M) / Z.
Input gradient dL/dX = g * sum_k (alpha_k A_k - B_k) (1 barrier) or sum_k G_k W_k (2 barriers).
T pass (`output_weight_grad_pass`): G_k = g * (alpha_k P_k - onehot_k); dL/dW_k = G_k^T X.
Padded rows (global index >= V) get logit -inf: they never enter the softmax and get zero grad.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

STATS_WIDTH = 3
"""Columns of the per-token stats tensor: local max, local sum-exp, target logit (0 elsewhere)."""


@dataclass(kw_only=True, slots=True)
class OutputShardState:
    """What one micro-batch's S pass keeps for the reduction and the T pass (mutable)."""

    logits: torch.Tensor
    """[n, v] shard GEMM output; only its grad_fn is used (the T pass backpropagates into W)."""
    probs: torch.Tensor
    """[n, v] P_k = exp(Y_k - m_k) / s_k (fp32, fp64 for fp64 logits); zero on padded rows."""
    local_max: torch.Tensor
    """[n] fp32 m_k, -inf when the shard is all padding."""
    local_sum: torch.Tensor
    """[n] fp32 s_k."""
    target_index: torch.Tensor
    """[n] int64 row of the label inside this shard (clamped; valid where target_in_shard)."""
    target_in_shard: torch.Tensor
    """[n] bool: the label's row belongs to this shard."""
    input_grad: torch.Tensor | None = None
    """[n, h] fp32 A_k = P_k W_k (1-barrier algorithm only); becomes alpha_k A_k - B_k."""
    target_rows: torch.Tensor | None = None
    """[n, h] fp32 B_k = W_k[y] where the label is in this shard, else 0 (1-barrier only)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenStats:
    """Per-token results of the stats reduction, identical on every rank of the group."""

    global_max: torch.Tensor
    """[n] fp32 M."""
    sum_exp: torch.Tensor
    """[n] fp32 Z = sum_k s_k exp(m_k - M)."""
    loss: torch.Tensor
    """[n] fp32 per-token cross-entropy log Z + M - logit_y."""


def output_forward_pass(
    hidden: torch.Tensor,  # [s, b, h] final hidden state (after the final norm)
    weight: torch.Tensor,  # [v, h] this shard of the output layer
    labels: torch.Tensor,  # [s, b] global token ids
    *,
    vocab_start: int,
    num_valid: int,
    fuse_input_grad: bool,
) -> tuple[OutputShardState, torch.Tensor]:
    """S pass. Returns the state to keep and the [n, 3] fp32 stats to all-gather."""
    n = hidden.shape[0] * hidden.shape[1]
    x = hidden.detach().reshape(n, hidden.shape[-1])  # [n, h]
    logits = F.linear(x, weight)  # [n, v], grad_fn accumulates into weight
    # fp32/fp64 logits are reused in place as the probabilities; bf16/fp16 get an fp32 copy.
    dtype = _compute_dtype(logits.dtype)
    probs = logits.detach() if logits.dtype == dtype else logits.detach().to(dtype)
    if num_valid < probs.shape[1]:
        probs[:, num_valid:] = float("-inf")  # padded rows leave the softmax
    target = labels.reshape(n)  # [n]
    in_shard = (target >= vocab_start) & (target < vocab_start + num_valid)  # [n]
    index = (target - vocab_start).clamp(0, probs.shape[1] - 1)  # [n]
    picked = probs.gather(1, index.unsqueeze(1)).squeeze(1)  # [n]
    target_logit = torch.where(in_shard, picked, torch.zeros_like(picked))  # [n]
    local_max = probs.max(dim=1).values  # [n]
    shift = torch.where(torch.isfinite(local_max), local_max, torch.zeros_like(local_max))
    probs.sub_(shift.unsqueeze(1)).exp_()  # [n, v] exp(Y - m), 0 on padding
    local_sum = probs.sum(dim=1)  # [n]
    probs.div_(torch.where(local_sum > 0, local_sum, torch.ones_like(local_sum)).unsqueeze(1))
    state = OutputShardState(
        logits=logits, probs=probs, local_max=local_max, local_sum=local_sum,
        target_index=index, target_in_shard=in_shard,
    )
    if fuse_input_grad:
        w = weight.detach().to(dtype)  # [v, h]
        state.input_grad = probs @ w  # [n, h]
        state.target_rows = w[index] * in_shard.unsqueeze(1)  # [n, h]
    if probs.data_ptr() != logits.data_ptr():
        _pseudo_free(logits)
    stats = torch.stack([local_max, local_sum, target_logit], dim=1)  # [n, 3]
    return state, stats


def combine_stats(gathered: torch.Tensor) -> TokenStats:  # gathered: [R, n, 3]
    """Stats reduction: the online-softmax rescaling of every shard's (m_k, s_k) to M."""
    local_max, local_sum, target_logit = gathered.unbind(dim=2)  # 3 x [R, n]
    global_max = local_max.max(dim=0).values  # [n]
    sum_exp = (local_sum * torch.exp(local_max - global_max)).sum(dim=0)  # [n]
    loss = torch.log(sum_exp) - (target_logit.sum(dim=0) - global_max)  # [n]
    return TokenStats(global_max=global_max, sum_exp=sum_exp, loss=loss)


def softmax_scale(state: OutputShardState, stats: TokenStats) -> torch.Tensor:
    """alpha_k [n]: the factor turning the local softmax P_k into the global softmax slice."""
    return state.local_sum * torch.exp(state.local_max - stats.global_max) / stats.sum_exp


def finish_fused_input_grad(state: OutputShardState, alpha: torch.Tensor) -> torch.Tensor:
    """1-barrier algorithm, between the two reductions: alpha_k A_k - B_k [n, h], in place."""
    assert state.input_grad is not None and state.target_rows is not None
    partial = state.input_grad.mul_(alpha.unsqueeze(1)).sub_(state.target_rows)  # [n, h]
    state.input_grad = state.target_rows = None
    return partial


def output_weight_grad_pass(
    state: OutputShardState,
    weight: torch.Tensor,  # [v, h]
    alpha: torch.Tensor,  # [n]
    token_grad: torch.Tensor,  # [n] g = dLoss/dloss_token (mask, averaging, loss scale)
    *,
    compute_input_grad: bool,
) -> torch.Tensor | None:
    """T pass: accumulate dL/dW_k through autograd (so DDP grad hooks fire).

    With compute_input_grad (2-barrier algorithm) also returns this shard's G_k W_k [n, h]
    (already multiplied by g) for the input-gradient all-reduce.
    """
    grad_logits = state.probs.mul_((alpha * token_grad).unsqueeze(1))  # [n, v], in place
    rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)  # [n]
    hit = token_grad * state.target_in_shard  # [n]
    grad_logits[rows, state.target_index] -= hit
    w = weight.detach().to(grad_logits.dtype)  # [v, h]
    input_grad = grad_logits @ w if compute_input_grad else None  # [n, h]
    _run_backward(state.logits, grad_logits.to(state.logits.dtype))
    state.probs = grad_logits = torch.empty(0)  # drop the [n, v] buffer now
    return input_grad


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics dtype: fp64 stays fp64 (parity tests), everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pseudo_free(tensor: torch.Tensor) -> None:
    """Drop a graph output's data, keeping its grad_fn (Megatron's deallocate_output_tensor)."""
    tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)


def _run_backward(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from `output` with `grad`, without the shape check (output may be pseudo-freed);
    the same C++-engine call as Megatron's custom_backward."""
    torch.autograd.Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )
