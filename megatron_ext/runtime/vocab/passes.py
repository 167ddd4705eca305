"""Runs one iteration's vocabulary passes on one rank (Yeung et al. 2025, sections 4-6).

Legend: s = sequence, b = micro-batch, n = s*b, h = hidden, v = shard rows, R = group size.

The schedule calls these methods in the order schedule_plan chose; every collective goes to a
per-kind worker (comm.py), so the main thread only waits where it needs a result:
  IF  input_forward      lookup, then all-reduce of the partial embeddings       (emb_fwd)
  --  take_embedding     first stage: the summed embedding [s, b, h], before its F
  --  publish_hidden     last stage: broadcast X [s, b, h] right after its F     (hidden)
  S   output_forward     logits, stats -> all-gather; 1 barrier: then, in the same job,
                         alpha*A - B -> all-reduce of the input gradient         (stats)
  L   token_losses /     last stage: per-token losses, then the token gradients g
      publish_token_grads  from the user's loss function, broadcast              (token_grad)
  T   output_backward    weight gradient; 2 barriers: + input-gradient all-reduce (input_grad)
  --  hidden_grad        last stage: dL/dX [s, b, h] for its B
  IB  input_backward     first stage broadcasts dL/d(embedding); all backprop it (emb_bwd)
Broadcast receives of all micro-batches are posted at the start (buffers are allocated by the
worker when a receive begins), so a broadcast only ever waits for its root.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch
import torch.distributed as dist

from megatron_ext.runtime.vocab import output_layer as out
from megatron_ext.runtime.vocab.comm import CommStreams, VocabCommGroups
from megatron_ext.runtime.vocab.input_layer import (
    EmbeddingLookup,
    accumulate_embedding_grad,
    embedding_forward_pass,
    flush_embedding_grad,
)
from megatron_ext.runtime.vocab.partition import VocabPartition


class VocabPassRunner:
    """Per-iteration state of the vocabulary passes on one rank of the vocabulary group."""

    def __init__(
        self,
        *,
        partition: VocabPartition,
        input_weight: torch.Tensor,  # [v, h]
        output_weight: torch.Tensor,  # [v, h]; the same tensor when embeddings are tied
        groups: VocabCommGroups,
        num_barriers: int,
        num_microbatches: int,
        hidden_shape: tuple[int, int, int],  # (s, b, h) of X and of the embedding output
        dtype: torch.dtype,
        is_first_stage: bool,
        is_last_stage: bool,
        forward_only: bool = False,
        thread_initializer: Callable[[], None] | None = None,
    ) -> None:
        if num_barriers not in (1, 2):
            raise ValueError(f"num_barriers={num_barriers} must be 1 or 2")
        assert groups.size == partition.num_shards, (groups.size, partition.num_shards)
        self.rank = groups.rank
        self.start, self.num_valid = partition.shard_start(self.rank), partition.num_valid(
            self.rank)
        self.w_in, self.w_out = input_weight, output_weight
        self.groups, self.barriers, self.m = groups, num_barriers, num_microbatches
        self.shape, self.dtype = hidden_shape, dtype
        self.n = hidden_shape[0] * hidden_shape[1]
        self.device = output_weight.device
        if self.device.type != "cpu":  # see the report: worker threads need side streams there
            raise NotImplementedError(
                f"vocabulary-parallel passes run on CPU/gloo only for now (weights on "
                f"{self.device}); accelerators need per-worker streams with event fences")
        self.streams = CommStreams(groups, thread_initializer=thread_initializer)
        self._fire: list[Future] = []  # jobs nobody waits for (roots' sends): checked at close
        self._emb: dict[int, tuple[EmbeddingLookup, Future | None]] = {}
        self._emb_grad: torch.Tensor | None = None  # [v, h], flushed into w_in at close
        self._out: dict[int, out.OutputShardState] = {}
        self._stats: dict[int, Future] = {}
        self._xgrad: dict[int, Future] = {}
        self._g: dict[int, torch.Tensor] = {}
        self._x_root: dict[int, torch.Tensor] = {}
        self.is_first_stage, self.is_last_stage = is_first_stage, is_last_stage
        self.forward_only = forward_only
        kinds = [("hidden", groups.last_stage_root)]
        if not forward_only:
            kinds += [("token_grad", groups.last_stage_root), ("emb_bwd", groups.first_stage_root)]
        self._recv = {kind: self._post_receives(kind, root) for kind, root in kinds}

    @property
    def is_hidden_root(self) -> bool:
        return self.rank == self.groups.last_stage_root

    @property
    def is_embedding_root(self) -> bool:
        return self.rank == self.groups.first_stage_root

    def _post_receives(self, kind: str, root: int) -> dict[int, Future]:
        if self.rank == root:
            return {}
        shape = (self.n,) if kind == "token_grad" else self.shape
        dtype = torch.float32 if kind == "token_grad" else self.dtype
        return {i: self.streams.submit(kind, _receive_job, shape, dtype, self.device, root)
                for i in range(self.m)}

    # ---- input embedding ----------------------------------------------------------------------

    def input_forward(self, i: int, tokens: torch.Tensor) -> None:  # tokens: [s, b]
        """IF: partial lookup, summed over the group in the background (in place)."""
        partial, lookup = embedding_forward_pass(tokens, self.w_in, vocab_start=self.start,
                                                 num_valid=self.num_valid)  # [s, b, h]
        self._emb[i] = (lookup, self.streams.submit("emb_fwd", _all_reduce_job, partial))
        if not self.is_first_stage:  # the sums only feed stage 0: drop the finished ones
            for j, (old, done) in list(self._emb.items()):
                if done is not None and done.done():
                    done.result()
                    self._emb[j] = (old, None)
            if self.forward_only:  # no IB will come for them
                self._emb = {j: v for j, v in self._emb.items() if v[1] is not None}

    def take_embedding(self, i: int) -> torch.Tensor:
        """First stage: wait for the summed embedding [s, b, h]; a leaf that retains its grad."""
        lookup, job = self._emb.pop(i) if self.forward_only else self._emb[i]
        assert job is not None, f"embedding {i} taken twice"
        summed = job.result()  # [s, b, h]
        if self.forward_only:
            return summed
        self._emb[i] = (lookup, None)
        return summed.requires_grad_()

    def input_backward(self, i: int, grad: torch.Tensor | None = None) -> None:
        """IB: the first stage's root passes dL/d(embedding) [s, b, h] and broadcasts it."""
        lookup, job = self._emb.pop(i)
        if job is not None:  # other ranks: the sum only fed stage 0
            job.result()
        if self.is_embedding_root:
            assert grad is not None, "the first stage's root must pass its embedding gradient"
            self._fire.append(self.streams.submit("emb_bwd", _broadcast_job, grad, self.rank))
        else:
            grad = self._recv["emb_bwd"].pop(i).result()
        if self._emb_grad is None:
            dtype = self.w_in.dtype if self.w_in.dtype in (torch.float32, torch.float64) else (
                torch.float32)
            self._emb_grad = torch.zeros(self.w_in.shape, dtype=dtype, device=self.device)
        accumulate_embedding_grad(self._emb_grad, lookup, grad)

    # ---- output layer -------------------------------------------------------------------------

    def publish_hidden(self, i: int, hidden: torch.Tensor) -> None:
        """Last stage's root, right after its F: broadcast X [s, b, h] to the group."""
        assert self.is_hidden_root
        self._x_root[i] = hidden = hidden.detach()
        self._fire.append(self.streams.submit("hidden", _broadcast_job, hidden, self.rank))

    def output_forward(self, i: int, labels: torch.Tensor) -> None:  # labels: [s, b]
        """S: local logits and stats, then the stats reduction (and, with 1 barrier, the input
        gradient reduction) in the background."""
        if self.is_hidden_root:
            hidden = self._x_root.pop(i)
        else:
            hidden = self._recv["hidden"].pop(i).result()  # [s, b, h]
        fused = self.barriers == 1 and not self.forward_only
        state, stats = out.output_forward_pass(
            hidden, self.w_out, labels, vocab_start=self.start, num_valid=self.num_valid,
            fuse_input_grad=fused)
        self._out[i] = state
        if self.forward_only:  # no T pass: keep only what the stats need
            state.probs = state.logits = torch.empty(0)
        gathered = torch.empty(self.groups.size * self.n, out.STATS_WIDTH, dtype=stats.dtype,
                               device=stats.device)  # [R * n, 3]
        stats_ready: Future = Future()
        self._stats[i] = stats_ready
        job = self.streams.submit("stats", _stats_job, stats, gathered, state, stats_ready,
                                  fused)
        if fused and self.is_last_stage:  # only the last stage's B uses dL/dX
            self._xgrad[i] = job
        else:
            self._fire.append(job)

    def token_losses(self, i: int) -> torch.Tensor:
        """Last stage: per-token cross-entropy [n] (s-major), after the stats reduction. In
        forward-only mode this ends the micro-batch on every rank that calls it."""
        loss = self._stats[i].result()[0].loss
        if self.forward_only:
            self.drop_output(i)
        return loss

    def drop_output(self, i: int) -> None:
        """Forward only: forget micro-batch i's S state once its stats are reduced."""
        self._stats.pop(i).result()
        self._out.pop(i)

    def publish_token_grads(self, i: int, token_grad: torch.Tensor) -> None:
        """Last stage: g = dLoss/dloss_token [n]; the root broadcasts it for the T passes."""
        self._g[i] = token_grad = token_grad.detach().float().reshape(self.n)
        if self.is_hidden_root:
            self._fire.append(
                self.streams.submit("token_grad", _broadcast_job, token_grad, self.rank))

    def output_backward(self, i: int) -> None:
        """T: weight gradient of the shard; with 2 barriers also the input-gradient reduction."""
        state = self._out.pop(i)
        _, alpha = self._stats.pop(i).result()
        received = self._recv["token_grad"].pop(i, None)
        if received is not None:
            received = received.result()  # consumed even where a local copy exists (tp > 1)
        if i in self._g:  # the last stage: its own g; the later of T and B drops it
            token_grad = self._g.pop(i) if self.barriers == 1 else self._g[i]
        else:
            token_grad = received
        partial = out.output_weight_grad_pass(state, self.w_out, alpha, token_grad,
                                              compute_input_grad=self.barriers == 2)
        if self.barriers == 2:
            job = self.streams.submit("input_grad", _all_reduce_job, partial)
            if self.is_last_stage:
                self._xgrad[i] = job
            else:
                self._fire.append(job)

    def hidden_grad(self, i: int) -> torch.Tensor:
        """Last stage: dL/dX [s, b, h] for its B (waits for the input-gradient reduction)."""
        grad = self._xgrad.pop(i).result()  # [n, h]
        if self.barriers == 1:  # T (after B) drops g
            grad = grad * self._g[i].to(grad.dtype).unsqueeze(1)
        else:  # T ran before
            del self._g[i]
        return grad.reshape(self.shape).to(self.dtype)  # [s, b, h]

    def close(self) -> None:
        """Wait for every background job (surfacing their errors) and stop the workers."""
        if self.forward_only:  # ranks off the last stage never read their losses
            for i in list(self._stats):
                self.drop_output(i)
            for _, job in self._emb.values():
                if job is not None:
                    job.result()
            self._emb.clear()
        for job in self._fire:
            job.result()
        self.streams.close()
        if self._emb_grad is not None:
            flush_embedding_grad(self.w_in, self._emb_grad)
            self._emb_grad = None
        leftovers = {k: v for k, v in (
            ("emb", self._emb), ("out", self._out), ("stats", self._stats), ("g", self._g),
            ("xgrad", self._xgrad), *self._recv.items()) if v}
        assert not leftovers, f"vocabulary passes left unfinished: {leftovers}"


# ---- worker jobs (first argument: the kind's duplicate group) -----------------------------------

# torch >= 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)



def _receive_job(group: dist.ProcessGroup, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, root: int) -> torch.Tensor:
    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buffer, group=group, group_src=root)
    return buffer


def _broadcast_job(group: dist.ProcessGroup, tensor: torch.Tensor, root: int) -> None:
    dist.broadcast(tensor, group=group, group_src=root)


def _all_reduce_job(group: dist.ProcessGroup, tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor, group=group)  # SUM, in place
    return tensor


def _stats_job(
    group: dist.ProcessGroup, stats: torch.Tensor, gathered: torch.Tensor,
    state: out.OutputShardState, stats_ready: Future, fused: bool,
) -> torch.Tensor | None:
    """All-gather the stats, combine (M, Z, loss) and alpha; with the fused input gradient
    (1 barrier) finish alpha*A - B and all-reduce it in the same communication phase."""
    try:
        _all_gather(gathered, stats.contiguous(), group=group)  # [R * n, 3]
        token_stats = out.combine_stats(gathered.view(group.size(), *stats.shape))
        alpha = out.softmax_scale(state, token_stats)  # [n]
        stats_ready.set_result((token_stats, alpha))
    except BaseException as err:  # surface in the main thread's .result()
        stats_ready.set_exception(err)
        raise
    if not fused:
        return None
    partial = out.finish_fused_input_grad(state, alpha)  # [n, h]
    dist.all_reduce(partial, group=group)
    return partial
