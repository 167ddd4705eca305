"""FlexSP data dispatcher: move each sequence's tokens from the rank that loaded it to the ranks
that run it, for every micro-batch of a StepPlan, in one all-to-all per step.

Legend: c = per-token columns (e.g. input id and label), t = this rank's tokens of a micro-batch.
Every rank holds the same plan (the planner is deterministic), so every rank derives the whole
traffic matrix locally and only token rows travel, unlike FlexSP's per-group broadcasts of ids
and its "every rank loads the whole global batch" loader (reference §7.4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ext.planner.flexsp.step_plan import SPGroup, StepPlan, token_split

__all__ = ["RankMicroBatch", "all_rank_microbatches", "dispatch_sequences", "position_ids",
           "rank_microbatches", "round_robin_owners"]

Piece = tuple[int, int, int]
"""(sequence id, first token, end token): a slice of one sequence."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankMicroBatch:
    """What one rank runs in one micro-batch."""

    microbatch: int
    """Index of the micro-batch in the plan."""
    group_start: int
    """First rank of this rank's group."""
    degree: int
    """Group size (Ulysses degree)."""
    seq_ids: tuple[int, ...]
    """The group's sequences, in packing order."""
    cu_seqlens: tuple[int, ...]
    """Boundaries of those sequences in the group's packed token stream."""
    token_counts: tuple[int, ...]
    """Tokens each group rank holds (even split of the stream, no padding)."""
    pieces: tuple[Piece, ...]
    """The sequence slices that make up this rank's tokens, in stream order."""
    group_rank: int
    """This rank's index inside its group."""

    @property
    def num_tokens(self) -> int:
        return sum(hi - lo for _, lo, hi in self.pieces)


def rank_microbatches(plan: StepPlan, rank: int) -> list[RankMicroBatch | None]:
    """Per micro-batch: this rank's work, or None when its group has no sequences."""
    return [_view(plan, m, mb.group_of_rank(rank), rank)
            for m, mb in enumerate(plan.microbatches)]


def all_rank_microbatches(plan: StepPlan) -> list[list[RankMicroBatch | None]]:
    """rank_microbatches for every rank at once: O(micro-batches x ranks)."""
    out: list[list[RankMicroBatch | None]] = [[] for _ in range(plan.num_gpus)]
    for m, mb in enumerate(plan.microbatches):
        for group in mb.groups:
            for rank in group.ranks:
                out[rank].append(_view(plan, m, group, rank))
    return out


def _view(plan: StepPlan, m: int, group: SPGroup, rank: int) -> RankMicroBatch | None:
    if not group.seq_ids:
        return None
    cu = [0]
    for seq in group.seq_ids:
        cu.append(cu[-1] + plan.lengths[seq])
    ranges = token_split(cu[-1], group.degree)
    lo, hi = ranges[rank - group.start_rank]
    pieces = tuple((seq, max(lo, a) - a, min(hi, b) - a)
                   for seq, a, b in zip(group.seq_ids, cu[:-1], cu[1:])
                   if max(lo, a) < min(hi, b))
    return RankMicroBatch(
        microbatch=m, group_start=group.start_rank, degree=group.degree,
        seq_ids=group.seq_ids, cu_seqlens=tuple(cu),
        token_counts=tuple(b - a for a, b in ranges), pieces=pieces,
        group_rank=rank - group.start_rank)


def round_robin_owners(num_sequences: int, world_size: int) -> list[int]:
    """Sequence i is loaded by rank i % world_size (a distributed sampler's split)."""
    return [i % world_size for i in range(num_sequences)]


def position_ids(view: RankMicroBatch, device: torch.device | None = None) -> torch.Tensor:
    """[t] position of each of this rank's tokens inside its own sequence (RoPE restarts)."""
    parts = [torch.arange(lo, hi, device=device) for _, lo, hi in view.pieces]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def dispatch_sequences(
    plan: StepPlan,
    rank: int,
    local: dict[int, torch.Tensor],  # seq id -> [s_i, c] rows of the sequences this rank loaded
    owners: Sequence[int],
    *,
    columns: int,
    dtype: torch.dtype = torch.long,
    device: torch.device | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor | None]:  # per micro-batch: [t, c] this rank's packed rows, or None
    """One all_to_all_single over `group` (default: world, whose rank `rank` is) delivers every
    micro-batch's rows; `columns`/`dtype`/`device` describe the rows (a rank may load nothing)."""
    world = dist.get_world_size(group)
    assert world == plan.num_gpus, "dispatch runs over the plan's ranks"
    views = all_rank_microbatches(plan)
    send: list[torch.Tensor] = []
    send_sizes = [0] * world
    for dst in range(world):
        for view in views[dst]:
            for seq, lo, hi in view.pieces if view else ():
                if owners[seq] == rank:
                    send.append(local[seq][lo:hi])
                    send_sizes[dst] += hi - lo
    mine = [(m, p) for m, view in enumerate(views[rank]) if view for p in view.pieces]
    recv_sizes = [0] * world
    for _, (seq, lo, hi) in mine:
        recv_sizes[owners[seq]] += hi - lo
    send_buf = torch.cat(send) if send else torch.zeros(0, columns, dtype=dtype,
                                                                 device=device)
    recv_buf = send_buf.new_empty(sum(recv_sizes), columns)  # [rows from every source, c]
    dist.all_to_all_single(recv_buf, send_buf, output_split_sizes=recv_sizes,
                           input_split_sizes=send_sizes, group=group)
    # rows arrive grouped by source rank, each source in my stream order: find every piece
    offsets = [sum(recv_sizes[:q]) for q in range(world)]
    per_mb: list[list[torch.Tensor]] = [[] for _ in views[rank]]
    for m, (seq, lo, hi) in mine:
        q = owners[seq]
        per_mb[m].append(recv_buf[offsets[q]:offsets[q] + hi - lo])
        offsets[q] += hi - lo
    return [None if view is None else torch.cat(parts) if parts else recv_buf[:0]
            for view, parts in zip(views[rank], per_mb)]

