"""Iteration time of a 1F1B (PipeDream-flush) pipeline with uneven stages and gradient tails.

Legend: p = pipeline stages, m = micro-batches, f_k / b_k = forward / backward seconds of one
micro-batch on stage k (all its layers, its vocabulary work and its per-micro-batch
communication), c_k = one activation (or gradient) message from stage k to its neighbour.
All functions broadcast over leading axes: arrays are [..., p], so the uniform search can score
thousands of layouts in one call.

  t_k      = f_k + b_k + 2 c_k                        steady-state slot of stage k
  T_pipe   = sum_k t_k + (m - 1) * max_k t_k          fill + drain + steady state; equals the
                                                      textbook (m + p - 1) t for equal stages
  finish_k = T_pipe - sum_{j<k} (b_j + c_j)           stage k runs its last backward earlier than
                                                      stage 0 by the backwards still to come
  tail_k   = R'_k + O_k + A'_k
      R_k: data-parallel gradient reduction. Megatron-LM's default (and DeepSpeed's engine at
           ZeRO 0-1): after the last backward, R'_k = R_k. With --overlap-grad-reduce it is
           launched bucket by bucket during the last micro-batch's backward; only what sticks
           out of that backward is exposed, and sharing the GPU slows the overlapped transfer by
           `slow`: R'_k = max(0, slow * R_k - b_k);
      O_k: optimizer step;
      A_k: ZeRO-1 parameter all-gather: after the optimizer step (A'_k = A_k) unless
           --overlap-param-gather overlaps it with the next iteration's first forward
           (A'_k = max(0, A_k - f_k)).
  T_iter   = max_k (finish_k + tail_k)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

OVERLAP_SLOWDOWN = 1.1
"""Default slowdown of communication that overlaps compute (Galvatron measures 1.1-1.3); a
cluster profile's measured `overlap_slowdown` replaces it (CostModel.overlap_slowdown)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineTime:
    """Result of `one_f_one_b`; arrays keep the caller's leading axes."""

    iteration_s: np.ndarray
    """Seconds per optimizer step, [...]."""
    stage_busy_s: np.ndarray
    """m * (f_k + b_k) + tail_k: the time stage k computes or waits on its own tail, [..., p]."""
    bubble_s: np.ndarray
    """Iteration time minus the busiest stage's busy time, [...]."""


def one_f_one_b(
    forward_s: np.ndarray,
    backward_s: np.ndarray,
    p2p_s: np.ndarray,
    grad_sync_s: np.ndarray,
    param_gather_s: np.ndarray,
    optimizer_s: np.ndarray,
    num_microbatches: int,
    overlap_slowdown: float = OVERLAP_SLOWDOWN,
    virtual_stages: int = 1,
    *,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
) -> PipelineTime:
    """Iteration time of 1F1B over stage arrays of shape [..., p] (see the module docstring).

    `virtual_stages` v > 1 prices Megatron's interleaved schedule approximately (plans have no
    virtual stages yet; tools/bench_published.py passes the degree a published run used): each
    stage holds v chunks, so fill and drain shrink to 1/v and every micro-batch crosses v times
    as many stage boundaries: slot_k = f_k + b_k + 2 v c_k,
    T_pipe = sum_k slot_k / v + (m - 1/v) max_k slot_k  ((m + (p-1)/v) t for equal stages)."""
    f, b, c = np.asarray(forward_s), np.asarray(backward_s), np.asarray(p2p_s)
    v = float(virtual_stages)
    slot = f + b + 2.0 * v * c
    pipe = slot.sum(axis=-1) / v + (num_microbatches - 1.0 / v) * slot.max(axis=-1)
    before = (np.cumsum(b + c, axis=-1) - (b + c)) / v
    finish = pipe[..., None] - before
    tail = gradient_tail_s(f, b, grad_sync_s, param_gather_s, optimizer_s, overlap_slowdown,
                           overlap_grad_reduce=overlap_grad_reduce,
                           overlap_param_gather=overlap_param_gather)
    iteration = (finish + tail).max(axis=-1)
    busy = num_microbatches * (f + b) + tail
    return PipelineTime(
        iteration_s=iteration, stage_busy_s=busy, bubble_s=iteration - busy.max(axis=-1)
    )


def num_warmup(stage: int, num_stages: int, num_microbatches: int, extra_warmup: int = 0) -> int:
    """Warm-up forwards of `stage` in Megatron's 1F1B: p - stage - 1 (megatron-core
    pipeline_parallel/schedules.py, forward_backward_pipelining_without_interleaving), plus
    `extra_warmup` (the vocabulary passes' delay), at most m."""
    return min(num_stages - stage - 1 + extra_warmup, num_microbatches)


def interleaved_warmup(stage: int, num_stages: int, num_microbatches: int,
                       virtual_stages: int) -> int:
    """Warm-up chunk forwards of `stage` in Megatron's interleaved 1F1B (p - stage - 1 with one
    chunk, as `num_warmup`): 2 (p - stage - 1) +
    (v - 1) p, at most m v (megatron-core pipeline_parallel/schedules.py,
    get_pp_rank_microbatches, with microbatch_group_size_per_vp_stage = p, its default)."""
    p, v = num_stages, virtual_stages
    if v == 1:
        return min(p - stage - 1, num_microbatches)
    return min(2 * (p - stage - 1) + (v - 1) * p, num_microbatches * v)


@functools.lru_cache(maxsize=256)
def interleaved_inflight(num_stages: int, num_microbatches: int,
                         virtual_stages: int) -> np.ndarray:  # [T, p, v]
    """Micro-batches whose activations each model chunk holds, right after every forward of
    the interleaved schedule (the moments memory peaks), per stage and chunk. Forward unit i
    runs chunk (i // p) % v, backward unit i chunk v - 1 - (i // p) % v (groups of p
    micro-batches per chunk); after warm-up W each forward of unit j follows j - W backwards.
    With v = 1 the peak is min(p - stage, m), 1F1B's count."""
    p, m, v = num_stages, num_microbatches, virtual_stages
    total = m * v
    units = np.arange(total)
    fwd = np.eye(v, dtype=np.int64)[(units // p) % v]  # [T, v] one-hot chunk of forward i
    bwd = np.eye(v, dtype=np.int64)[v - 1 - (units // p) % v]
    fwd_done = np.cumsum(fwd, axis=0)  # after forward j: forwards 0..j
    bwd_cum = np.vstack([np.zeros((1, v), dtype=np.int64), np.cumsum(bwd, axis=0)])
    out = np.zeros((total, p, v), dtype=np.int64)
    for k in range(p):
        warm = interleaved_warmup(k, p, m, v)
        done = np.clip(units - warm, 0, total)  # backwards finished before forward j
        out[:, k, :] = fwd_done - bwd_cum[done]
    out.flags.writeable = False  # cached: shared by every caller
    return out


@functools.lru_cache(maxsize=256)
def interleaved_peak_units(num_stages: int, num_microbatches: int,
                           virtual_stages: int) -> np.ndarray:  # [p]
    """Most chunk micro-batches in flight at once per stage (all chunks together)."""
    out = interleaved_inflight(num_stages, num_microbatches, virtual_stages).sum(axis=-1)
    out = out.max(axis=0)
    out.flags.writeable = False
    return out


def one_f_one_b_order(
    stage: int, num_stages: int, num_microbatches: int, extra_warmup: int = 0
) -> list[tuple[str, int]]:
    """The compute passes of `stage` in Megatron's 1F1B order: ("F", i) / ("B", i) for
    micro-batch i; num_warmup forwards, then one forward and one backward per remaining
    micro-batch, then the cool-down backwards. The event simulations of the profiled cost model
    (planner/profile/pipeline.py) and of the vocabulary schedule (planner/vocab/schedule_ops.py)
    play this order; `one_f_one_b` is its closed form."""
    m = num_microbatches
    warm = num_warmup(stage, num_stages, m, extra_warmup)
    ops = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", i) for i in range(m - warm, m)]


def gradient_tail_s(
    forward_s: np.ndarray,
    backward_s: np.ndarray,
    grad_sync_s: np.ndarray,
    param_gather_s: np.ndarray,
    optimizer_s: float | np.ndarray,
    overlap_slowdown: float = OVERLAP_SLOWDOWN,
    *,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
) -> np.ndarray:
    """What stage k adds after its last backward: exposed gradient reduction, optimizer step,
    exposed parameter all-gather (all of them unless the overlap flags say otherwise)."""
    exposed_sync = np.asarray(grad_sync_s, dtype=float)
    if overlap_grad_reduce:
        exposed_sync = np.maximum(0.0, overlap_slowdown * exposed_sync - backward_s)
    exposed_gather = np.asarray(param_gather_s, dtype=float)
    if overlap_param_gather:
        exposed_gather = np.maximum(0.0, exposed_gather - forward_s)
    return exposed_sync + np.asarray(optimizer_s) + exposed_gather


def pipeline_lower_bound_s(total_stage_time_s: float, pp: int, num_microbatches: int) -> float:
    """No 1F1B schedule of total per-micro-batch work W over p stages beats (m + p - 1) W / p:
    T_pipe = sum t + (m-1) max t >= W + (m-1) W / p."""
    return total_stage_time_s * (num_microbatches + pp - 1) / pp


def mfu(tokens_per_s: float, flops_per_token: float, num_gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: useful FLOPs per second over the cluster's dense peak."""
    return tokens_per_s * flops_per_token / (num_gpus * peak_flops)
