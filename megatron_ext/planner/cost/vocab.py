"""Costs of the vocabulary layers (input embedding, output layer, softmax cross-entropy) per stage.

Legend: p = pp, W = ranks per stage, t_v = vocab.tp, dp_v = W / t_v data-parallel replicas of the
vocabulary layers, n = B * s / dp_v tokens per replica and micro-batch, V = padded vocabulary,
h = hidden, e = bytes per activation element.

mode "tp" (Megatron): the embedding [V/t_v, h] sits on stage 0, the output layer (its own weight,
or a copy of the tied one) on stage p-1; with t_v > 1 both run sequence-parallel. Logits
[n, V/t_v] are materialised once per micro-batch on the last stage: bf16 output plus the fp32
softmax the cross-entropy keeps for backward.

mode "vocab_parallel" (Yeung et al. 2025, one-barrier variant, plan `algorithm=1`): both layers are
split over all p * t_v ranks (shard V / (p t_v)); every stage computes its logits shard for every
micro-batch, so the last stage no longer carries the output layer. Its collectives (broadcast of
the last stage's hidden state, the statistics all-reduces, the input-gradient all-reduce, the
embedding all-reduce and gradient broadcast) run on a side stream, hidden behind the stage's own
layer compute; it costs one more in-flight micro-batch on every stage (two with 2 barriers),
and the passes hold their own state (`vocab_parallel_state_bytes`).

The vocabulary layers use the distributed optimizer (ZeRO-1 over dp_v) iff `vocab_zero` >= 1;
plans set it when any transformer layer uses zero >= 1 (Megatron's global flag).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from megatron_ext.geometry.vocab_partition import padded_vocab_size
from megatron_ext.plan import VocabStrategy
from megatron_ext.planner.cost import compute as C
from megatron_ext.planner.cost.comm import GroupLayout
from megatron_ext.planner.cost.memory import state_bytes_per_param
from megatron_ext.planner.cost.pipeline import interleaved_inflight
from megatron_ext.specs import ModelSpec

if TYPE_CHECKING:
    from megatron_ext.planner.cost.model import CostModel



@dataclass(frozen=True, kw_only=True, slots=True)
class StageExtras:
    """What each stage carries besides its transformer layers, for one vocabulary layout; [p]."""

    fixed_bytes: np.ndarray
    """Vocabulary weights, gradients, optimizer states, activations and logits peak."""
    forward_s: np.ndarray
    """Vocabulary compute and its blocking communication, per micro-batch forward."""
    backward_s: np.ndarray
    """The same for backward."""
    overlap_comm_s: np.ndarray
    """Side-stream communication per micro-batch, hidden behind the stage's layer compute."""
    grad_sync_s: np.ndarray
    """Once per iteration: gradient reduction of the vocabulary weights (+ tied-embedding sync)."""
    param_gather_s: np.ndarray
    """Once per iteration: ZeRO-1 weight all-gather."""
    optimizer_s: np.ndarray
    """Once per iteration: optimizer step on the vocabulary shard."""
    p2p_s: np.ndarray
    """One activation message from this stage to its neighbour."""
    inflight: np.ndarray
    """Micro-batches whose layer activations are alive at once under 1F1B (interleaved: those
    of the chunk holding the vocabulary layer)."""


def inflight_microbatches(pp: int, num_microbatches: int, vocab: VocabStrategy) -> np.ndarray:
    """1F1B keeps p - k micro-batches on stage k (one without pipelining); vocabulary
    parallelism delays each first backward by one slot (two for the two-barrier variant)."""
    extra = 0 if vocab.mode == "tp" or pp == 1 else vocab.algorithm
    return np.minimum(pp - np.arange(pp) + extra, num_microbatches).astype(np.int64)


def stage_extras(
    cm: CostModel, vocab: VocabStrategy, pp: int, micro_batch_size: int, num_microbatches: int,
    vocab_zero: int, virtual_stages: int = 1,
) -> StageExtras:
    """Per-stage vocabulary costs of `vocab` (cm is the CostModel). With virtual_stages v > 1
    (interleaved schedule, vocabulary mode tp) `inflight` counts the micro-batches of the
    chunk holding the vocabulary layer: chunk 0 on the first stage, chunk v-1 on the last."""
    t = cm.training
    width = cm.cluster.num_gpus // pp
    dpv = width // vocab.tp
    tokens = micro_batch_size * t.seq_length / dpv
    inflight = inflight_microbatches(pp, num_microbatches, vocab)
    if virtual_stages > 1:
        peak = interleaved_inflight(pp, num_microbatches, virtual_stages).max(axis=0)  # [p, v]
        inflight = peak[:, -1].copy()
        inflight[0] = peak[0, 0]
    params, fwd, bwd, fixed, overlap = _place(cm, vocab, pp, width, tokens, inflight,
                                              num_microbatches)
    fwd = fwd + cm.compute.host_for(cm.cluster).microbatch_s  # every stage: schedule, data
    per_param = state_bytes_per_param(
        min(vocab_zero, 1),
        dpv,
        half_precision=t.half_precision,
        num_optimizer_states=t.num_optimizer_states,
        half_grads=t.keeps_half_grads,
    )
    fixed += params * per_param
    sync, gather, opt = _vocab_data_parallel(
        cm, params, dpv, vocab.tp, vocab_zero, vocab, pp, width
    )
    return StageExtras(
        fixed_bytes=fixed,
        forward_s=fwd,
        backward_s=bwd,
        overlap_comm_s=overlap,
        grad_sync_s=sync,
        param_gather_s=gather,
        optimizer_s=opt,
        p2p_s=np.full(pp, cm.p2p_s(pp, micro_batch_size)),
        inflight=inflight,
    )


def _place(cm: CostModel, vocab: VocabStrategy, pp: int, width: int, tokens: float,
           inflight: np.ndarray, num_microbatches: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(params, forward s, backward s, activation bytes, side-stream comm s) per stage [pp]."""
    model, e, tv = cm.model, cm.element_bytes, vocab.tp
    spread = pp if vocab.mode == "vocab_parallel" else 1
    shard_rows = padded_vocab_size(model.vocab_size, tv * spread) / (tv * spread)
    weight_params = shard_rows * model.hidden_size
    pos = model.max_position_embeddings * model.hidden_size
    pos = pos if model.position_embedding == "learned_absolute" else 0
    params, fwd, bwd, fixed, overlap = (np.zeros(pp) for _ in range(5))
    hidden = tokens * model.hidden_size * e  # one replica's [n, h]
    tp_gather = float(cm.comm.time_s("all_gather", hidden, cm.layout(tv, 1))) if tv > 1 else 0.0
    out_f, out_b = C.output_layer_compute_s(
        model, cm.cluster, cm.compute, tokens=tokens, vocab_shard=shard_rows, element_bytes=e
    )
    emb_f, emb_b = C.embedding_compute_s(
        model, cm.cluster, cm.compute, tokens=tokens, element_bytes=e
    )
    stats = (
        2 * float(cm.comm.time_s("all_reduce", tokens * 4.0, cm.layout(tv, 1))) if tv > 1 else 0.0
    )
    last = pp - 1
    if vocab.mode == "tp":
        params[0] += weight_params + pos
        if not model.tied_embeddings or pp > 1:
            params[last] += weight_params
        fwd[0] += emb_f + tp_gather
        bwd[0] += emb_b + tp_gather
        fwd[last] += out_f + tp_gather + stats
        bwd[last] += out_b + tp_gather
    else:
        params += weight_params * (1 if model.tied_embeddings else 2)
        params[0] += pos
        fwd += out_f + emb_f + stats
        bwd += out_b + emb_b
        overlap += _vocab_parallel_comm_s(cm, pp, width, tv, hidden)
    fixed = vocab_activation_bytes(model, vocab, pp, tokens, inflight, element_bytes=e,
                                   dropout=cm.training.dropout,
                                   num_microbatches=num_microbatches)
    return params, fwd, bwd, fixed, overlap


def vocab_activation_bytes(model: ModelSpec, vocab: VocabStrategy, pp: int, tokens: float,
                           inflight: np.ndarray, *, element_bytes: int, dropout: bool,
                           num_microbatches: int) -> np.ndarray:
    """Activation bytes of the vocabulary layers per stage [pp]; `tokens` = n, one replica's
    tokens per micro-batch, `inflight` the micro-batches alive per stage.

    mode "tp": the first stage keeps, per in-flight micro-batch, the embedding's token ids
    (int64; with t_v > 1 also its out-of-shard mask, bool) and the embedding dropout's mask
    ([n/t_v, h], 1 byte); the last stage the final norm's input and the output layer's input
    ([n/t_v, h] each) per in-flight micro-batch, and for the one micro-batch whose loss runs the
    cross-entropy's fp32 softmax [n, V/t_v], its target mask (bool) and shard-local targets
    (int64) (megatron-core tensor_parallel/cross_entropy.py:28, 65, 187: the logits are cast to
    fp32 and exponentiated in place, so fp32 logits are kept once and half-precision ones add
    their own e bytes while the loss's forward runs). tools/bench_memory.py measures it.

    mode "vocab_parallel": what the passes hold (`vocab_parallel_state_bytes`, with
    `output_state_bound` S states over the step's `num_microbatches`) plus the
    last stage's final-norm input per in-flight micro-batch."""
    e, tv, h = element_bytes, vocab.tp, model.hidden_size
    spread = pp if vocab.mode == "vocab_parallel" else 1
    shard_rows = padded_vocab_size(model.vocab_size, tv * spread) / (tv * spread)
    norm_in = e * tokens * h / tv  # final-norm input, [n/t_v, h]
    logits = tokens * shard_rows
    fixed = np.zeros(pp)
    last = pp - 1
    if vocab.mode == "tp":
        ids = tokens * (8 + (1 if tv > 1 else 0))
        mask = tokens * h / tv if dropout else 0.0
        fixed[0] += inflight[0] * (ids + mask)
        fixed[last] += (inflight[last] * 2 * norm_in + logits * (4 + (e if e != 4 else 0))
                        + 9 * tokens)
    else:
        m = num_microbatches
        fixed += vocab_parallel_state_bytes(model, vocab, pp, tokens, m, element_bytes=e,
                                            output_states=output_state_bound(pp, m))
        fixed[last] += inflight[last] * norm_in
    return fixed


def output_state_bound(pp: int, num_microbatches: int) -> np.ndarray:
    """Micro-batches whose output-layer S state a stage holds at once under the planned
    vocabulary-parallel schedule, bounded: 3 on the last stage, 2 elsewhere (the planner's
    schedules keep 1-3, the last stage the most, depending on the pass costs:
    tests/unit/test_vocab_schedule.py checks <= 3; tools/bench_memory.py measures it)."""
    return np.minimum(num_microbatches, np.where(np.arange(pp) == pp - 1, 3, 2))


def vocab_parallel_state_bytes(model: ModelSpec, vocab: VocabStrategy, pp: int, tokens: float,
                               num_microbatches: int, *, element_bytes: int,
                               output_states: np.ndarray) -> np.ndarray:
    """Bytes the vocabulary-parallel passes hold at their peak on one rank of each stage [pp]
    (runtime/vocab/passes.py; n = `tokens`, v = V / (p t_v) shard rows, R = p t_v ranks):
      S states   per micro-batch between its S and T pass (`output_states` of them): the fp32
                 softmax [n, v], the hidden state X [n, h] the logits GEMM saved, with one
                 barrier the fp32 input-gradient partial and label rows [n, h] each, and
                 29 n + 12 R n bytes of per-token statistics and their all-gather
      receives   each broadcast kind posted W = `receive_window` micro-batches ahead (receive
                 j + W when j is consumed; all m at once when m <= W): X [n, h] (min(W + c, m)
                 buffers, c of them the S states' X), the embedding gradient [n, h] and the
                 token gradients [n] fp32 (min(W, m) each); with t_v = 1 the last stage roots
                 X and the token gradients, the first stage the embedding gradient
      lookups    every micro-batch's token ids and shard mask (9 n) from IF to IB
      first stage  two summed embeddings [n, h] awaiting their transformer forward
      last stage   its own token gradients [n] fp32 (two micro-batches' with 2 barriers)
    tools/bench_memory.py measures it (exact at the measured c on both barrier counts)."""
    from megatron_ext.planner.vocab.schedule_ops import receive_window

    e, tv, h, m = element_bytes, vocab.tp, model.hidden_size, num_microbatches
    ranks = pp * tv
    rows = padded_vocab_size(model.vocab_size, ranks) / ranks
    hidden = tokens * h * e
    one_barrier = vocab.algorithm == 1
    state = (tokens * rows * 4 + hidden + (2 * tokens * h * 4 if one_barrier else 0.0)
             + (29 + 12 * ranks) * tokens)
    window = receive_window(pp, vocab.algorithm)
    last = pp - 1
    stage = np.arange(pp)
    roots = tv == 1
    x_posted = np.minimum(window + output_states, m) - output_states
    receives = (np.where(roots & (stage == last), 0.0, x_posted * hidden
                         + min(window, m) * 4 * tokens)
                + np.where(roots & (stage == 0), 0.0, min(window, m) * hidden))
    out = output_states * state + receives + m * 9 * tokens
    out[0] += 2 * hidden
    out[last] += vocab.algorithm * 4 * tokens
    return np.asarray(out, dtype=float)


def _vocab_parallel_comm_s(cm: CostModel, pp: int, width: int, tv: int, hidden: float) -> float:
    """Per micro-batch: broadcast of the hidden state over the pp ranks, fp32 input-gradient
    all-reduce and embedding all-reduce over the p * t_v vocabulary group, gradient broadcast
    back to every stage."""
    g = cm.cluster.nvlink_domain
    pp_layout = cm.layout(pp, width)
    per_node = min(pp * tv, tv * max(1, min(pp, g // width)) if width < g else tv)
    group = GroupLayout(size=pp * tv, ranks_per_node=max(1, per_node))
    bcast = 2 * float(cm.comm.time_s("broadcast", hidden, pp_layout))
    reduce = float(cm.comm.time_s("all_reduce", hidden / cm.element_bytes * 4.0, group))
    reduce += float(cm.comm.time_s("all_reduce", hidden, group))
    return bcast + reduce


def _vocab_data_parallel(
    cm: CostModel,
    params: np.ndarray,
    dpv: int,
    tv: int,
    vocab_zero: int,
    vocab: VocabStrategy,
    pp: int,
    width: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    layout = cm.layout(dpv, tv)
    gb = cm.training.grad_reduce_bytes  # bytes per gradient element in the reduction
    if vocab_zero >= 1:
        op, op_bytes = cm.training.zero1_grad_reduce
        sync = np.asarray(cm.comm.time_s(op, params * op_bytes, layout), dtype=float)
        gather = np.asarray(
            cm.comm.time_s("all_gather", params * cm.element_bytes, layout), dtype=float
        )
        shard = params / dpv
    else:
        sync = np.asarray(cm.comm.time_s("all_reduce", params * gb, layout), dtype=float)
        gather = np.zeros_like(params)
        shard = params
    if dpv == 1:
        sync, gather = np.zeros_like(params), np.zeros_like(params)
    sync = np.where(params > 0, sync, 0.0)
    gather = np.where(params > 0, gather, 0.0)
    if vocab.mode == "tp" and cm.model.tied_embeddings and pp > 1:
        # Megatron all-reduces the tied weight's gradient between the first and last stage.
        tie = cm.comm.time_s("all_reduce", params[0] * gb, cm.layout(2, (pp - 1) * width))
        sync = sync.copy()
        sync[0] += float(tie)
        sync[-1] += float(tie)
    opt = np.asarray(C.optimizer_step_s(shard, cm.cluster, cm.compute), dtype=float)
    return sync, gather, opt
