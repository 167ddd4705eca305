"""FlexSP step plan: micro-batches, each a set of aligned Ulysses groups with their sequences.

Pure data (no torch). Sequences are referred to by their index in the step's `lengths`. A group's
sequences are packed in the listed order into one token stream of `sum(lengths)` tokens, which is
cut evenly over the group's ranks (`token_split`); each rank also knows the whole group's
cu_seqlens because attention runs on all tokens after the Ulysses all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_ext.errors import PlanError


def token_split(num_tokens: int, degree: int) -> list[tuple[int, int]]:
    """Half-open token ranges of the `degree` ranks of a group holding `num_tokens` packed tokens.

    Rank i holds [floor(i*T/d), floor((i+1)*T/d)): sizes differ by at most one, no padding.
    """
    return [(i * num_tokens // degree, (i + 1) * num_tokens // degree) for i in range(degree)]


@dataclass(frozen=True, kw_only=True, slots=True)
class SPGroup:
    """One Ulysses group of one micro-batch: an aligned contiguous rank range and its sequences."""

    start_rank: int
    """First rank; a multiple of `degree` (aligned)."""
    degree: int
    """Ranks in the group, a power of two."""
    seq_ids: tuple[int, ...] = ()
    """Indices into the step's lengths, in packing order; empty for an idle group."""
    predicted_time_s: float = 0.0
    """Cost-model time of this group in its micro-batch (without the fixed per-micro-batch term)."""

    @property
    def ranks(self) -> range:
        return range(self.start_rank, self.start_rank + self.degree)


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchPlan:
    """Concurrent groups of one micro-batch, ascending start ranks, covering every device."""

    groups: tuple[SPGroup, ...]
    """The groups, sorted by start rank."""
    predicted_time_s: float
    """Fixed per-micro-batch time plus the slowest group."""

    def group_of_rank(self, rank: int) -> SPGroup:
        for group in self.groups:
            if group.start_rank <= rank < group.start_rank + group.degree:
                return group
        raise PlanError(f"rank {rank} is in no group of this micro-batch")

    def degrees(self) -> tuple[int, ...]:
        return tuple(sorted((g.degree for g in self.groups), reverse=True))


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPlan:
    """All micro-batches of one optimizer step."""

    lengths: tuple[int, ...]
    """Token length of every sequence of the global batch; sequence ids index this."""
    num_gpus: int
    """Devices the plan covers."""
    microbatches: tuple[MicroBatchPlan, ...]
    """Run one after another with gradient accumulation."""
    predicted_time_s: float
    """Sum of the micro-batch times."""

    def check(self, *, capacity_tokens: int | None = None) -> None:
        """Raise PlanError unless every sequence is in exactly one group, groups are aligned
        powers of two covering [0, num_gpus), every rank of a busy group holds a token, and (if
        given) no device exceeds its tokens."""
        seen = [0] * len(self.lengths)
        for m, mb in enumerate(self.microbatches):
            next_rank = 0
            for g in mb.groups:
                if g.degree < 1 or g.degree & (g.degree - 1) or g.start_rank % g.degree:
                    raise PlanError(f"microbatch {m}: group at {g.start_rank} of degree "
                                    f"{g.degree} is not an aligned power of two")
                if g.start_rank != next_rank:
                    raise PlanError(f"microbatch {m}: groups leave a gap or overlap at rank "
                                    f"{next_rank}")
                next_rank += g.degree
                tokens = sum(self.lengths[i] for i in g.seq_ids)
                if 0 < tokens < g.degree:
                    raise PlanError(f"microbatch {m}: group at {g.start_rank} holds {tokens} "
                                    f"tokens, fewer than its {g.degree} ranks; use smaller groups")
                if capacity_tokens is not None and -(-tokens // g.degree) > capacity_tokens:
                    raise PlanError(f"microbatch {m}: group at {g.start_rank} holds {tokens} "
                                    f"tokens over {g.degree} devices of {capacity_tokens}")
                for i in g.seq_ids:
                    seen[i] += 1
            if next_rank != self.num_gpus:
                raise PlanError(f"microbatch {m}: groups cover {next_rank} of {self.num_gpus}")
        bad = [i for i, n in enumerate(seen) if n != 1]
        if bad:
            raise PlanError(f"sequences {bad[:5]} are planned {seen[bad[0]]} times, not once")

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_gpus": self.num_gpus,
            "predicted_time_s": self.predicted_time_s,
            "lengths": list(self.lengths),
            "microbatches": [
                {
                    "predicted_time_s": mb.predicted_time_s,
                    "groups": [
                        {"start_rank": g.start_rank, "degree": g.degree,
                         "seq_ids": list(g.seq_ids), "predicted_time_s": g.predicted_time_s}
                        for g in mb.groups
                    ],
                }
                for mb in self.microbatches
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepPlan:
        plan = cls(
            lengths=tuple(int(x) for x in data["lengths"]),
            num_gpus=int(data["num_gpus"]),
            predicted_time_s=float(data["predicted_time_s"]),
            microbatches=tuple(
                MicroBatchPlan(
                    predicted_time_s=float(mb["predicted_time_s"]),
                    groups=tuple(
                        SPGroup(start_rank=int(g["start_rank"]), degree=int(g["degree"]),
                                seq_ids=tuple(int(i) for i in g["seq_ids"]),
                                predicted_time_s=float(g["predicted_time_s"]))
                        for g in mb["groups"]
                    ),
                )
                for mb in data["microbatches"]
            ),
        )
        plan.check()
        return plan

    def summary(self) -> str:
        """Aligned plain-text table: one line per micro-batch (degree multiset, tokens, times)."""
        header = (f"{'mb':>3}  {'groups (degree x count)':<34} {'seqs':>5} {'tokens':>9} "
                  f"{'pred s':>8}")
        lines = [header]
        for m, mb in enumerate(self.microbatches):
            counts: dict[int, int] = {}
            for g in mb.groups:
                counts[g.degree] = counts.get(g.degree, 0) + 1
            shape = " ".join(f"{d}x{n}" for d, n in sorted(counts.items(), reverse=True))
            seqs = [i for g in mb.groups for i in g.seq_ids]
            tokens = sum(self.lengths[i] for i in seqs)
            lines.append(f"{m:>3}  {shape:<34} {len(seqs):>5} {tokens:>9} "
                         f"{mb.predicted_time_s:>8.3f}")
        lines.append(f"step: {len(self.lengths)} sequences, {self.num_tokens} tokens, "
                     f"{len(self.microbatches)} micro-batches, "
                     f"predicted {self.predicted_time_s:.3f} s")
        return "\n".join(lines)
