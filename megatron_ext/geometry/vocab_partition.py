"""How the vocabulary is split over the vocabulary-parallel group (Yeung et al. 2025, section 4).

Legend: V = real vocabulary size, n = shards (pp x tp ranks), v = V_pad / n rows per shard.

Every rank of the group holds rows [k*v, (k+1)*v) of the padded vocabulary for BOTH the input
embedding and the output layer, k = its rank in the group, so tied weights stay rank-local.
Rows >= V are padding: their logits are masked out of the softmax and their token ids never occur.
"""

from __future__ import annotations

from dataclasses import dataclass


def padded_vocab_size(vocab_size: int, num_shards: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padding: V up to a multiple of --make-vocab-size-divisible-by x (ranks
    sharing the vocabulary). The model builders and `VocabPartition.create` use it."""
    if divisible_by < 1:
        raise ValueError(f"divisible_by={divisible_by} must be >= 1")
    multiple = divisible_by * num_shards
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True, kw_only=True, slots=True)
class VocabPartition:
    """A padded split of the vocabulary over `num_shards` ranks."""

    vocab_size: int
    """V: real vocabulary size (token ids are in [0, V))."""
    num_shards: int
    """n: ranks of the vocabulary-parallel group (pipeline x tensor-parallel ranks)."""
    padded_vocab_size: int
    """V_pad >= V, a multiple of num_shards."""

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 1")
        if self.num_shards < 1:
            raise ValueError(f"num_shards={self.num_shards} must be >= 1")
        if self.padded_vocab_size < self.vocab_size or self.padded_vocab_size % self.num_shards:
            raise ValueError(
                f"padded_vocab_size={self.padded_vocab_size} must be >= vocab_size="
                f"{self.vocab_size} and a multiple of num_shards={self.num_shards}"
            )

    @classmethod
    def create(
        cls, vocab_size: int, num_shards: int, *, divisible_by: int = 1
    ) -> VocabPartition:
        """Pad V up to a multiple of num_shards * divisible_by (Megatron's
        --make-vocab-size-divisible-by, applied per shard as the reference implementation does)."""
        padded = padded_vocab_size(vocab_size, num_shards, divisible_by)
        return cls(vocab_size=vocab_size, num_shards=num_shards, padded_vocab_size=padded)

    @property
    def shard_size(self) -> int:
        """v: rows per shard."""
        return self.padded_vocab_size // self.num_shards

    def shard_start(self, rank: int) -> int:
        """First (padded) vocabulary row of shard `rank`."""
        assert 0 <= rank < self.num_shards, (rank, self.num_shards)
        return rank * self.shard_size

    def num_valid(self, rank: int) -> int:
        """Rows of shard `rank` below V, i.e. real tokens; the rest are padding."""
        start = self.shard_start(rank)
        return max(0, min(self.shard_size, self.vocab_size - start))
