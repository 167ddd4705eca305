"""Activation layouts: which part of a `[s, b, h]` activation each rank of a pipeline stage holds.

Legend: s = sequence, b = micro-batch (samples over all data-parallel replicas), h = hidden;
S = ranks of one pipeline stage, local rank = rank - stage * S.

An ActivationLayout splits the activation over S = tp * ulysses * cp * dp ranks. Rank order
inside a stage is Megatron's with tensor parallelism innermost (adjacent ranks, inside a node):

    local_rank = tp_rank + tp * (ulysses_rank + ulysses * (cp_rank + cp * dp_rank))

- dp: the batch is cut into dp contiguous slices, `[s, b/dp, h]`.
- cp: Megatron's load-balanced context parallelism: the sequence is cut into 2*cp chunks and
  cp rank i holds chunks i and 2*cp-1-i, in that order (`get_batch_on_this_cp_rank`).
- ulysses: a contiguous split of the cp-local sequence: the Ulysses degree of attention layers
  (LayerStrategy.ulysses); the embedding/output layers use it as a plain token split.
- tp with sp: Megatron sequence parallelism splits that sequence once more, `[s/tp, b, h]`;
  tp without sp: the tp ranks hold identical replicas.

Sequence positions are handled as "chunks": a layout with `seq_chunks() = G` holds whole chunks
of s/G tokens; two layouts compare at the granularity lcm(G_a, G_b), which divides s whenever
both G_a and G_b do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from megatron_ext.plan import LayerStrategy

__all__ = ["ActivationLayout", "RankCoords"]


class RankCoords(NamedTuple):
    """Coordinates of one local rank in an ActivationLayout."""

    tp: int
    ulysses: int
    cp: int
    dp: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationLayout:
    """How the S ranks of one pipeline stage hold a `[s, b, h]` activation. Hashable."""

    tp: int = 1
    """Tensor-parallel group size: ranks that replicate (or, with sp, sequence-split) a block."""
    sp: bool = False
    """Megatron sequence parallelism: the tp ranks split the sequence instead of replicating."""
    cp: int = 1
    """Context-parallel degree: load-balanced split of the sequence into 2*cp chunks."""
    ulysses: int = 1
    """Contiguous split of the cp-local sequence: the Ulysses degree of attention layers
    (LayerStrategy.ulysses), a plain token split for the vocabulary layers."""
    dp: int = 1
    """Batch split."""

    def __post_init__(self) -> None:
        if min(self.tp, self.cp, self.ulysses, self.dp) < 1:
            raise ValueError(f"layout degrees must be >= 1: {self}")
        if self.sp and self.tp == 1:
            raise ValueError(f"sp=True needs tp > 1: {self}")

    @classmethod
    def of(cls, strategy: LayerStrategy) -> ActivationLayout:
        """The layout a transformer layer with `strategy` takes as input and produces."""
        return cls(tp=strategy.tp, sp=strategy.sp, cp=strategy.cp, ulysses=strategy.ulysses,
                   dp=strategy.dp)

    @property
    def width(self) -> int:
        """Ranks the layout spans: tp * ulysses * cp * dp."""
        return self.tp * self.ulysses * self.cp * self.dp

    def describe(self) -> str:
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else "")]
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"uly{self.ulysses}"] if self.ulysses > 1 else []
        return " ".join(parts + [f"dp{self.dp}"])

    # ---- rank arithmetic --------------------------------------------------------------------

    def coords(self, local_rank: int) -> RankCoords:
        assert 0 <= local_rank < self.width, (local_rank, self)
        tp_rank = local_rank % self.tp
        rest = local_rank // self.tp
        ulysses_rank = rest % self.ulysses
        rest //= self.ulysses
        return RankCoords(tp=tp_rank, ulysses=ulysses_rank, cp=rest % self.cp, dp=rest // self.cp)

    def rank_of(self, coords: RankCoords) -> int:
        return coords.tp + self.tp * (
            coords.ulysses + self.ulysses * (coords.cp + self.cp * coords.dp))

    def replicas(self, local_rank: int) -> tuple[int, ...]:
        """Local ranks holding exactly the same block as `local_rank` (itself included)."""
        if self.sp:
            return (local_rank,)
        base = local_rank - local_rank % self.tp
        return tuple(range(base, base + self.tp))

    # ---- which data a rank holds ------------------------------------------------------------

    def seq_chunks(self) -> int:
        """Granularity G of the sequence split: (2*cp if cp > 1) * ulysses * (tp if sp)."""
        return (2 * self.cp if self.cp > 1 else 1) * self.ulysses * (self.tp if self.sp else 1)

    def chunk_ids(self, local_rank: int, granularity: int | None = None) -> tuple[int, ...]:
        """Global sequence-chunk ids held by `local_rank`, in local order.

        Chunks are s/granularity tokens long; granularity must be a multiple of seq_chunks().
        """
        own = self.seq_chunks()
        granularity = own if granularity is None else granularity
        assert granularity % own == 0, (granularity, self)
        c = self.coords(local_rank)
        units: tuple[int, ...]
        if self.cp > 1:
            units = (c.cp, 2 * self.cp - 1 - c.cp)
            per_unit = own // (2 * self.cp)
        else:
            units, per_unit = (0,), own
        ids = [u * per_unit + i for u in units for i in range(per_unit)]  # cp-local sequence
        part = len(ids) // self.ulysses
        ids = ids[c.ulysses * part:(c.ulysses + 1) * part]  # Ulysses / contiguous split
        if self.sp:
            part = len(ids) // self.tp
            ids = ids[c.tp * part:(c.tp + 1) * part]  # Megatron SP split
        factor = granularity // own
        return tuple(i * factor + j for i in ids for j in range(factor))

    def positions(self, local_rank: int, seq_length: int) -> list[int]:
        """Global token positions held by `local_rank`, in local order."""
        granularity = self.seq_chunks()
        if seq_length % granularity:
            raise ValueError(f"seq_length={seq_length} is not divisible by {granularity} ({self})")
        size = seq_length // granularity
        return [c * size + i for c in self.chunk_ids(local_rank) for i in range(size)]

    def batch_range(self, local_rank: int, batch: int) -> tuple[int, int]:
        """Half-open sample range [start, stop) held by `local_rank`."""
        if batch % self.dp:
            raise ValueError(f"micro-batch of {batch} samples does not split over dp={self.dp}")
        per = batch // self.dp
        dp_rank = self.coords(local_rank).dp
        return dp_rank * per, (dp_rank + 1) * per

    def local_shape(self, seq_length: int, batch: int) -> tuple[int, int]:
        """(s_local, b_local) of every rank's block."""
        return (seq_length // (self.cp * self.ulysses * (self.tp if self.sp else 1)),
                batch // self.dp)

    def attention_layout(self) -> ActivationLayout:
        """The layout inside attention, after the SP all-gather: tp ranks replicate again."""
        return ActivationLayout(tp=self.tp, sp=False, cp=self.cp, ulysses=self.ulysses,
                                dp=self.dp)


def common_granularity(a: ActivationLayout, b: ActivationLayout) -> int:
    """Finest chunk granularity both layouts are whole multiples of."""
    return math.lcm(a.seq_chunks(), b.seq_chunks())
