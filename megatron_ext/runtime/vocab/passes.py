"""Runs one iteration's vocabulary passes on one rank (Yeung et al. 2025, sections 4-6).

Legend: s = sequence, b = micro-batch, n = s*b, h = hidden, v = shard rows, R = group size.

The schedule calls these methods in the order schedule_plan chose. Every collective is issued
asynchronously on its kind's group (comm.py) and its handle is waited on exactly where the result
is needed, so the caller keeps running transformer passes meanwhile:
  IF  input_forward      lookup, then all-reduce of the partial embeddings       (emb_fwd)
  --  take_embedding     first stage: waits for the summed embedding [s, b, h], before its F
  --  publish_hidden     last stage: broadcast X [s, b, h] right after its F     (hidden)
  S   output_forward     logits, stats -> all-gather                             (stats)
                         1 barrier: its completion callback computes alpha*A - B
                         and all-reduces it                                      (input_grad)
  L   token_losses /     last stage: per-token losses, then the token gradients g
      publish_token_grads  from the user's loss function, broadcast              (token_grad)
  T   output_backward    weight gradient; 2 barriers: + input-gradient all-reduce (input_grad)
  --  hidden_grad        last stage: waits for dL/dX [s, b, h] for its B
  IB  input_backward     first stage broadcasts dL/d(embedding); all backprop it (emb_bwd)
Broadcast receives are posted `receive_window` micro-batches ahead (receive j + window when
receive j is consumed; schedule_ops.receive_window), so a broadcast does not wait for a late
receiver and at most `window` receive buffers per kind exist; the deadlock check models this.

One code path on every device (no branch on device type or backend). The only work between two
collectives, the 1-barrier stats -> input-gradient step, runs in the stats all-gather's
completion callback (`Work.get_future().then`, as PyTorch's DDP communication hooks chain
collectives): on gloo in the group's thread once the gather is done, on NCCL at once on the host
but on a side stream fenced by the gather's events. Waiting on a handle blocks the host on gloo and
only the current stream on a device, so both wait at the same points, the ones the deadlock check
of schedule_sim.py models. Tensors a callback reads stay referenced here until the caller has
waited on that callback (the caching allocator then cannot hand their memory to the main stream
while a side stream still reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.futures import Future

from megatron_ext.geometry.vocab_partition import VocabPartition
from megatron_ext.runtime.vocab import output_layer as out
from megatron_ext.runtime.vocab.comm import Background, InOrder, VocabCommGroups
from megatron_ext.runtime.vocab.input_layer import (
    EmbeddingLookup,
    accumulate_embedding_grad,
    embedding_forward_pass,
    flush_embedding_grad,
)

# torch >= 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass(frozen=True, slots=True)
class _Posted:
    """A collective in flight and the tensor it fills (or reduces in place)."""

    work: dist.Work
    tensor: torch.Tensor

    def result(self) -> torch.Tensor:
        self.work.wait()
        return self.tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class _StatsReduction:
    """Micro-batch i's stats reduction: the callback's future, whose value is (loss [n],
    alpha [n]), and every tensor the callback reads (kept until the caller waited on it)."""

    future: Future
    keep: tuple[torch.Tensor | None, ...]

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        loss, alpha = self.future.wait()
        return loss, alpha


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
        receive_window: int | None = None,  # None: all micro-batches' receives at the start
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
        self.device = output_weight.device  # receive buffers go where the weights are
        self._background = Background()
        self._in_order = InOrder()  # the stats callbacks' input-gradient all-reduces
        self._lookups: dict[int, EmbeddingLookup] = {}
        self._emb_sum: dict[int, _Posted] = {}  # first stage: the summed embeddings
        self._emb_grad: torch.Tensor | None = None  # [v, h], flushed into w_in at close
        self._out: dict[int, out.OutputShardState] = {}
        self._stats: dict[int, _StatsReduction] = {}
        self._xgrad: dict[int, _Posted] = {}  # last stage: dL/dX (/ g with 1 barrier) [n, h]
        self._g: dict[int, torch.Tensor] = {}
        self._x_root: dict[int, torch.Tensor] = {}
        self.is_first_stage, self.is_last_stage = is_first_stage, is_last_stage
        self.forward_only = forward_only
        self.window = num_microbatches if receive_window is None else receive_window
        if self.window < 1:
            raise ValueError(f"receive_window={receive_window} must be >= 1")
        self._roots = {"hidden": groups.last_stage_root}
        if not forward_only:
            self._roots |= {"token_grad": groups.last_stage_root,
                            "emb_bwd": groups.first_stage_root}
        self._recv: dict[str, dict[int, _Posted]] = {kind: {} for kind in self._roots}
        for kind in self._roots:
            for i in range(min(self.window, self.m)):
                self._post_receive(kind, i)

    @property
    def is_hidden_root(self) -> bool:
        return self.rank == self.groups.last_stage_root

    @property
    def is_embedding_root(self) -> bool:
        return self.rank == self.groups.first_stage_root

    def _post_receive(self, kind: str, i: int) -> None:
        root = self._roots[kind]
        if self.rank == root or i >= self.m:
            return
        shape = (self.n,) if kind == "token_grad" else self.shape
        dtype = torch.float32 if kind == "token_grad" else self.dtype
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self._recv[kind][i] = _Posted(self._broadcast(kind, buffer, root), buffer)

    def _receive(self, kind: str, i: int) -> torch.Tensor | None:
        """Micro-batch i's broadcast (None on its root); posts the receive `window` ahead."""
        posted = self._recv[kind].pop(i, None)
        self._post_receive(kind, i + self.window)
        return None if posted is None else posted.result()

    def _broadcast(self, kind: str, tensor: torch.Tensor, root: int) -> dist.Work:
        return dist.broadcast(tensor, group=getattr(self.groups, kind), group_src=root,
                              async_op=True)

    def _all_reduce(self, kind: str, tensor: torch.Tensor) -> dist.Work:
        return dist.all_reduce(tensor, group=getattr(self.groups, kind), async_op=True)  # SUM

    # ---- input embedding ----------------------------------------------------------------------

    def input_forward(self, i: int, tokens: torch.Tensor) -> None:  # tokens: [s, b]
        """IF: partial lookup, summed over the group in the background (in place)."""
        self._background.reap()
        partial, lookup = embedding_forward_pass(tokens, self.w_in, vocab_start=self.start,
                                                 num_valid=self.num_valid)  # [s, b, h]
        work = self._all_reduce("emb_fwd", partial)
        if self.is_first_stage:
            self._emb_sum[i] = _Posted(work, partial)
        else:  # the sum only feeds stage 0
            self._background.add(work, partial)
        if not self.forward_only:  # IB needs the lookup
            self._lookups[i] = lookup

    def take_embedding(self, i: int) -> torch.Tensor:
        """First stage: wait for the summed embedding [s, b, h]; a leaf that retains its grad."""
        summed = self._emb_sum.pop(i).result()  # [s, b, h]
        return summed if self.forward_only else summed.requires_grad_()

    def input_backward(self, i: int, grad: torch.Tensor | None = None) -> None:
        """IB: the first stage's root passes dL/d(embedding) [s, b, h] and broadcasts it."""
        self._background.reap()
        lookup = self._lookups.pop(i)
        if self.is_embedding_root:
            assert grad is not None, "the first stage's root must pass its embedding gradient"
            self._background.add(self._broadcast("emb_bwd", grad, self.rank), grad)
        else:
            grad = self._receive("emb_bwd", i)
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
        self._background.add(self._broadcast("hidden", hidden, self.rank), hidden)

    def output_forward(self, i: int, labels: torch.Tensor) -> None:  # labels: [s, b]
        """S: local logits and stats, then the stats reduction (and, with 1 barrier, the input
        gradient reduction) in the background."""
        self._background.reap()
        received = self._receive("hidden", i)  # [s, b, h]
        hidden = self._x_root.pop(i) if self.is_hidden_root else received
        fused = self.barriers == 1 and not self.forward_only
        state, stats = out.output_forward_pass(
            hidden, self.w_out, labels, vocab_start=self.start, num_valid=self.num_valid,
            fuse_input_grad=fused)
        self._out[i] = state
        if self.forward_only:  # no T pass: keep only what the stats need
            state.probs = state.logits = torch.empty(0)
        stats = stats.contiguous()  # [n, 3]
        gathered = torch.empty(self.groups.size * self.n, out.STATS_WIDTH, dtype=stats.dtype,
                               device=stats.device)  # [R * n, 3]
        work = _all_gather(gathered, stats, group=self.groups.stats, async_op=True)
        keep = (stats, gathered, state.local_sum, state.local_max, state.input_grad,
                state.target_rows)
        future = work.get_future().then(
            lambda done: self._in_order.run(i, lambda: self._reduce_stats(i, done, gathered,
                                                                          state, fused)))
        self._stats[i] = _StatsReduction(future=future, keep=keep)

    def _reduce_stats(self, i: int, gather: Future, gathered: torch.Tensor,
                      state: out.OutputShardState, fused: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Completion callback of S's all-gather: combine (M, Z, loss) and alpha; with the
        fused input gradient (1 barrier) finish alpha*A - B and all-reduce it, in the same
        communication phase. Returns (loss [n], alpha [n])."""
        gather.value()  # raises the all-gather's error, if any
        token_stats = out.combine_stats(gathered.view(self.groups.size, self.n,
                                                      out.STATS_WIDTH))
        alpha = out.softmax_scale(state, token_stats)  # [n]
        if fused:
            partial = out.finish_fused_input_grad(state, alpha)  # [n, h]
            work = self._all_reduce("input_grad", partial)
            if self.is_last_stage:  # only the last stage's B uses dL/dX
                self._xgrad[i] = _Posted(work, partial)
            else:
                self._background.add(work, partial)
        return token_stats.loss, alpha

    def token_losses(self, i: int) -> torch.Tensor:
        """Last stage: per-token cross-entropy [n] (s-major), after the stats reduction. In
        forward-only mode this ends the micro-batch on every rank that calls it."""
        loss, _ = self._stats[i].result()
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
            self._background.add(self._broadcast("token_grad", token_grad, self.rank),
                                 token_grad)

    def output_backward(self, i: int) -> None:
        """T: weight gradient of the shard; with 2 barriers also the input-gradient reduction."""
        self._background.reap()
        state = self._out.pop(i)
        _, alpha = self._stats.pop(i).result()
        received = self._receive("token_grad", i)  # also where a local copy exists (tp > 1)
        if i in self._g:  # the last stage: its own g; the later of T and B drops it
            token_grad = self._g.pop(i) if self.barriers == 1 else self._g[i]
        else:
            token_grad = received
        partial = out.output_weight_grad_pass(state, self.w_out, alpha, token_grad,
                                              compute_input_grad=self.barriers == 2)
        if self.barriers == 2:
            work = self._all_reduce("input_grad", partial)
            if self.is_last_stage:
                self._xgrad[i] = _Posted(work, partial)
            else:
                self._background.add(work, partial)

    def hidden_grad(self, i: int) -> torch.Tensor:
        """Last stage: dL/dX [s, b, h] for its B (waits for the input-gradient reduction)."""
        if self.barriers == 1 and i in self._stats:  # the stats callback issues it
            self._stats[i].result()
        grad = self._xgrad.pop(i).result()  # [n, h]
        if self.barriers == 1:  # T (after B) drops g
            grad = grad * self._g[i].to(grad.dtype).unsqueeze(1)
        else:  # T ran before
            del self._g[i]
        return grad.reshape(self.shape).to(self.dtype)  # [s, b, h]

    def close(self) -> None:
        """Wait for every collective still in flight (surfacing their errors)."""
        if self.forward_only:  # ranks off the last stage never read their losses
            for i in list(self._stats):
                self.drop_output(i)
        self._background.drain()
        if self._emb_grad is not None:
            flush_embedding_grad(self.w_in, self._emb_grad)
            self._emb_grad = None
        leftovers = {k: v for k, v in (
            ("emb", self._emb_sum), ("lookups", self._lookups), ("out", self._out),
            ("stats", self._stats), ("g", self._g), ("xgrad", self._xgrad),
            *self._recv.items()) if v}
        assert not leftovers, f"vocabulary passes left unfinished: {leftovers}"
