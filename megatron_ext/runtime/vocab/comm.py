"""Communication for the vocabulary passes: dedicated groups, asynchronous collectives.

Every kind of vocabulary collective gets its own duplicate of the vocabulary group and is issued
with `async_op=True`; the caller keeps the work handle and waits on it exactly where the result
is needed (passes.py). One code path for every backend:
  * gloo (CPU): the group's own threads run the collective; `wait()` blocks the caller.
  * NCCL and other device backends: the collective runs on the group's own stream; `wait()`
    makes the caller's current stream wait (an event fence), the host does not block.
Separate groups keep collectives of different kinds from ever queueing behind each other (as
the reference implementation keeps vocabulary collectives off the pipeline P2P communicator to
avoid ordering deadlocks), and each group sees its collectives in micro-batch order on every
rank, whatever order the schedule interleaves the kinds in: this is what makes per-rank pass
orders safe to differ.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

GROUP_KINDS: tuple[str, ...] = ("hidden", "stats", "input_grad", "token_grad", "emb_fwd", "emb_bwd")
"""One duplicate group per collective kind; see VocabCommGroups for what each carries."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VocabCommGroups:
    """The vocabulary-parallel group (pp x tp ranks of one model replica) and its duplicates.

    Group rank k holds vocabulary shard k. All groups have the same ranks in the same order."""

    vocab: dist.ProcessGroup
    """The vocabulary-parallel group itself (sizes and ranks only; no traffic)."""
    hidden: dist.ProcessGroup
    """Broadcast of the last stage's final hidden state X [s, b, h] (before every S pass)."""
    stats: dist.ProcessGroup
    """All-gather of per-token (max, sum-exp, target logit) after every S pass."""
    input_grad: dist.ProcessGroup
    """All-reduce of the input gradient: issued by the stats reduction's completion callback
    (1-barrier algorithm) or by the T pass (2-barrier algorithm)."""
    token_grad: dist.ProcessGroup
    """Broadcast of the per-token loss gradient g [s*b] from the last stage (for T passes)."""
    emb_fwd: dist.ProcessGroup
    """All-reduce of the partial input embeddings [s, b, h] (IF)."""
    emb_bwd: dist.ProcessGroup
    """Broadcast of the first stage's embedding gradient [s, b, h] (IB)."""
    last_stage_root: int
    """Group rank broadcasting X and g: a rank of the last pipeline stage."""
    first_stage_root: int
    """Group rank broadcasting the embedding gradient: a rank of the first pipeline stage."""

    @property
    def size(self) -> int:
        return self.vocab.size()

    @property
    def rank(self) -> int:
        return self.vocab.rank()

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dist.ProcessGroup) and value.size() != self.vocab.size():
                raise ValueError(f"group {f.name} has {value.size()} ranks, vocab has "
                                 f"{self.vocab.size()}; create all duplicates over the same ranks")
        for name in ("last_stage_root", "first_stage_root"):
            if not 0 <= getattr(self, name) < self.vocab.size():
                raise ValueError(f"{name}={getattr(self, name)} is not a rank of the vocab group")


def vocab_rank_lists(stage_ranks: list[list[int]], vocab_tp: int) -> list[list[int]]:
    """Global ranks of every vocabulary group, ordered by shard: replica k takes ranks
    [k*tp, (k+1)*tp) of each stage, stage by stage (shard = stage * tp + tp rank, as in the
    reference implementation). `stage_ranks[r]` lists stage r's global ranks in order."""
    width = len(stage_ranks[0])
    if vocab_tp < 1 or width % vocab_tp or any(len(ranks) != width for ranks in stage_ranks):
        raise ValueError(f"vocab tp={vocab_tp} must divide every stage's {width} ranks")
    return [[rank for ranks in stage_ranks for rank in ranks[k * vocab_tp:(k + 1) * vocab_tp]]
            for k in range(width // vocab_tp)]


def new_vocab_comm_groups(
    rank_lists: list[list[int]], *, last_stage_root: int, first_stage_root: int
) -> VocabCommGroups:
    """Create the vocabulary group and its duplicates for every model replica.

    Collective over the default group: every process calls it with the same `rank_lists` (one
    list of global ranks per replica, ordered by vocabulary shard). Returns this rank's groups.
    """
    created: dict[str, Any] = {}
    for kind in ("vocab", *GROUP_KINDS):
        created[kind], _ = dist.new_subgroups_by_enumeration(rank_lists)
    return VocabCommGroups(
        last_stage_root=last_stage_root, first_stage_root=first_stage_root, **created
    )


class InOrder:
    """Runs `step(i)` for i = 0, 1, 2, ... in that order, whichever thread calls first.

    Completion callbacks of one group's collectives may fire out of order (gloo runs a group's
    collectives on several threads); the collectives they issue must still reach their own
    group in micro-batch order on every rank. A caller whose turn has not come waits for its
    predecessor, which never depends on the waiting thread: the predecessor's collective has
    been posted by every rank already (its successor completed)."""

    def __init__(self) -> None:
        self._next = 0
        self._turn = threading.Condition()

    def run(self, index: int, step: Callable[[], T]) -> T:
        with self._turn:
            self._turn.wait_for(lambda: self._next == index)
            try:
                return step()
            finally:  # a failed step still hands the turn on; its error goes to its waiter
                self._next += 1
                self._turn.notify_all()


class Background:
    """Collectives nobody reads the result of (roots' broadcasts, reductions only another stage
    consumes): kept with the tensors they use until they complete, then checked."""

    def __init__(self) -> None:
        self._works: list[tuple[dist.Work, tuple[torch.Tensor, ...]]] = []
        self._lock = threading.Lock()  # completion callbacks add from the groups' threads

    def add(self, work: dist.Work, *tensors: torch.Tensor) -> None:
        with self._lock:
            self._works.append((work, tensors))

    def reap(self) -> None:
        """Forget the completed ones (wait() surfaces their errors; it cannot block here)."""
        with self._lock:
            flags = [w[0].is_completed() for w in self._works]
            done = [w for w, f in zip(self._works, flags, strict=True) if f]
            self._works = [w for w, f in zip(self._works, flags, strict=True) if not f]
        for work, _ in done:
            work.wait()

    def drain(self) -> None:
        """Wait for all of them."""
        while True:
            with self._lock:
                if not self._works:
                    return
                work, _ = self._works.pop(0)
            work.wait()
