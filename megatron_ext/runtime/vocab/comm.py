"""Communication for the vocabulary passes: dedicated groups, each drained by its own worker.

Every kind of vocabulary collective gets its own duplicate of the vocabulary group and one
worker thread (the CPU analogue of the reference implementation's side CUDA stream), so
  * collectives never block the main thread, which keeps running transformer passes, and
  * each group sees its collectives in micro-batch order on every rank, whatever order the
    schedule interleaves the kinds in: this is what makes per-rank pass orders safe to differ.
The reference implementation likewise keeps vocabulary collectives off the pipeline P2P
communicator to avoid ordering deadlocks.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import torch.distributed as dist

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
    """All-gather of per-token (max, sum-exp, target logit); under the 1-barrier algorithm
    followed, in the same job, by the all-reduce of the input gradient."""
    input_grad: dist.ProcessGroup
    """2-barrier algorithm: all-reduce of the input gradient after the T passes."""
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


class CommStreams:
    """One single-worker FIFO per group kind. `submit` returns a Future; jobs of one kind run
    in submission order, so every rank must submit each kind's jobs in micro-batch order."""

    def __init__(
        self, groups: VocabCommGroups, *, thread_initializer: Callable[[], None] | None = None
    ) -> None:
        """`thread_initializer` runs once in each worker (e.g. a profiler's per-thread setup)."""
        self.groups = groups
        self._workers = {
            kind: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"vocab-{kind}",
                                     initializer=thread_initializer)
            for kind in GROUP_KINDS
        }

    def submit(self, kind: str, job: Callable[..., Any], *args: Any) -> Future:
        return self._workers[kind].submit(job, getattr(self.groups, kind), *args)

    def close(self) -> None:
        for worker in self._workers.values():
            worker.shutdown(wait=True)
