"""The vocabulary passes on 2 gloo ranks, recorded: the collectives a GPU run would issue.

Rank 0 is the first pipeline stage, rank 1 the last; the vocabulary (fp64, 11 rows: the last
shard padded) is split over both. The transformer body is the identity, so X is the summed
embedding: rank 0 sends it to rank 1 and gets dL/dX back (plain send/recv, not recorded). For
each algorithm (1 and 2 barriers) and a receive window of 1 (every later receive is posted by
the pass that consumes the one before), checked against one process with torch autograd:
per-token losses of every micro-batch, dL/dX, and the full input-embedding and output-layer
gradients (the shards gathered). And: every collective the passes issue is asynchronous
(`async_op=True`, a handle waited where the result is needed): the code path that a device
backend takes, since the runtime has no other (tests/unit/test_vocab_device_agnostic.py).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext.runtime.testing import run_distributed

pytestmark = pytest.mark.dist

VOCAB, HIDDEN, SEQ, MBS, MICROBATCHES = 11, 6, 5, 3, 4
TOL = {"rtol": 1e-10, "atol": 1e-10}
"""fp64: the sharded and the single-process computations only reorder sums."""


def _data() -> tuple[torch.Tensor, torch.Tensor, list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(7)
    w_in = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    w_out = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    batches = [{"tokens": torch.randint(0, VOCAB, (SEQ, MBS), generator=gen),
                "labels": torch.randint(0, VOCAB, (SEQ, MBS), generator=gen),
                # the runtime carries g in fp32: values exact in fp32 keep fp64 parity
                "g": torch.rand(SEQ * MBS, generator=gen).double()}
               for _ in range(MICROBATCHES)]
    return w_in, w_out, batches


def _reference(barriers: int) -> dict[str, Any]:
    del barriers  # both algorithms compute the same thing
    w_in, w_out, batches = _data()
    w_in, w_out = w_in.requires_grad_(), w_out.requires_grad_()
    losses, xgrads = [], []
    for batch in batches:
        x = F.embedding(batch["tokens"], w_in)  # [s, b, h]
        x.retain_grad()
        loss = F.cross_entropy(x.reshape(-1, HIDDEN) @ w_out.t(), batch["labels"].reshape(-1),
                               reduction="none")  # [n]
        (loss * batch["g"]).sum().backward()
        losses.append(loss.detach())
        xgrads.append(x.grad)
    return {"losses": losses, "xgrads": xgrads, "w_in": w_in.grad, "w_out": w_out.grad}


def _rank(rank: int, world_size: int) -> dict[int, dict[str, Any]]:
    """Both algorithms, one spawn."""
    return {barriers: _run(rank, world_size, barriers) for barriers in (1, 2)}


def _run(rank: int, world_size: int, barriers: int) -> dict[str, Any]:
    from megatron_ext.runtime.vocab import passes

    calls: list[tuple[str, bool]] = []

    def recorded(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, kwargs.get("async_op", False)))
            return real(*args, **kwargs)
        return call

    real_gather = passes._all_gather
    passes.dist = _RecordingDist(recorded)  # the real collectives, each call recorded
    passes._all_gather = recorded("all_gather", real_gather)
    try:
        return _passes(rank, world_size, barriers, calls)
    finally:
        passes.dist, passes._all_gather = dist, real_gather


def _passes(rank: int, world_size: int, barriers: int, calls: list) -> dict[str, Any]:
    from megatron_ext.geometry.vocab_partition import VocabPartition
    from megatron_ext.runtime.vocab.comm import new_vocab_comm_groups
    from megatron_ext.runtime.vocab.passes import VocabPassRunner

    part = VocabPartition.create(VOCAB, world_size)
    w_in_full, w_out_full, batches = _data()
    rows = slice(part.shard_start(rank), part.shard_start(rank) + part.num_valid(rank))
    w_in = torch.zeros(part.shard_size, HIDDEN, dtype=torch.float64)
    w_out = torch.zeros(part.shard_size, HIDDEN, dtype=torch.float64)
    w_in[:part.num_valid(rank)] = w_in_full[rows]
    w_out[:part.num_valid(rank)] = w_out_full[rows]
    w_in.requires_grad_()
    w_out.requires_grad_()
    groups = new_vocab_comm_groups([[0, 1]], last_stage_root=1, first_stage_root=0)
    first, last = rank == 0, rank == 1
    runner = VocabPassRunner(
        partition=part, input_weight=w_in, output_weight=w_out, groups=groups,
        num_barriers=barriers, num_microbatches=MICROBATCHES, hidden_shape=(SEQ, MBS, HIDDEN),
        dtype=torch.float64, is_first_stage=first, is_last_stage=last, receive_window=1)
    losses, xgrads = [], []
    for i, batch in enumerate(batches):
        runner.input_forward(i, batch["tokens"])
        if first:
            dist.send(runner.take_embedding(i).detach(), dst=1)
        else:
            x = torch.empty(SEQ, MBS, HIDDEN, dtype=torch.float64)
            dist.recv(x, src=0)
            runner.publish_hidden(i, x)
        runner.output_forward(i, batch["labels"])
        if last:
            losses.append(runner.token_losses(i))
            runner.publish_token_grads(i, batch["g"])
        if barriers == 2 or first:  # 2 barriers: T's reduction feeds the last stage's B
            runner.output_backward(i)
        if last:
            xgrads.append(runner.hidden_grad(i))
            dist.send(xgrads[-1], dst=0)
            if barriers == 1:
                runner.output_backward(i)
            runner.input_backward(i)
        else:
            grad = torch.empty(SEQ, MBS, HIDDEN, dtype=torch.float64)
            dist.recv(grad, src=1)
            runner.input_backward(i, grad)
    runner.close()
    full = {}
    for name, weight in (("w_in", w_in), ("w_out", w_out)):
        shards = [torch.empty_like(weight.grad) for _ in range(world_size)]
        dist.all_gather(shards, weight.grad)
        full[name] = torch.cat(shards)[:VOCAB]
    return {"losses": losses, "xgrads": xgrads, **full, "calls": calls}


class _RecordingDist:
    """torch.distributed for the passes module, with its collectives recorded."""

    def __init__(self, recorded: Any) -> None:
        self._recorded = recorded

    def __getattr__(self, name: str) -> Any:
        real = getattr(dist, name)
        return self._recorded(name, real) if name in ("broadcast", "all_reduce") else real


@functools.cache
def _outcomes() -> list[dict[int, dict[str, Any]]]:
    return run_distributed(_rank, world_size=2, timeout_s=300, collective_timeout_s=60)


@pytest.mark.parametrize("barriers", [1, 2])
def test_passes_match_one_process_and_issue_only_async_collectives(barriers: int) -> None:
    ranks = [outcome[barriers] for outcome in _outcomes()]
    expected = _reference(barriers)
    last = ranks[1]
    for got, want in zip(last["losses"], expected["losses"], strict=True):
        torch.testing.assert_close(got, want, **TOL)
    for got, want in zip(last["xgrads"], expected["xgrads"], strict=True):
        torch.testing.assert_close(got, want, **TOL)
    for rank in ranks:
        torch.testing.assert_close(rank["w_in"], expected["w_in"], **TOL)
        torch.testing.assert_close(rank["w_out"], expected["w_out"], **TOL)
        kinds = {name for name, _ in rank["calls"]}
        assert kinds == {"broadcast", "all_reduce", "all_gather"}, kinds
        blocking = [name for name, is_async in rank["calls"] if not is_async]
        assert not blocking, f"collectives issued synchronously: {blocking}"
        # per micro-batch: the embedding sum, the input-gradient sum, the stats gather, and
        # 3 broadcasts (X, g, the embedding gradient) sent or received
        assert len(rank["calls"]) == 6 * MICROBATCHES
