"""FlexSP group pool: every aligned power-of-two rank range, one communicator each, built once.

A FlexSP plan (planner/flexsp) places a group of degree d at a start rank that is a multiple of
d, so the groups any plan can use are the ranges [k*d, (k+1)*d) for d = 2, 4, ..., max_degree:
about N communicators in all, each rank a member of log2(max_degree) of them. They are created
up front, in the same order on every rank (`new_group` is collective over the world), so
switching groups between micro-batches is free ("hot switching", FlexSP §7.1) and no collective
is ever issued lazily in the middle of a step. Rank sets are shared through
`runtime.groups.GroupCache`, so a range that is also the world reuses WORLD.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_ext.errors import PlanError
from megatron_ext.runtime.groups import GroupCache

__all__ = ["FlexSPGroups"]


class FlexSPGroups:
    """This rank's handles of all aligned groups up to `max_degree` (collective constructor)."""

    def __init__(self, *, max_degree: int, world_size: int | None = None,
                 cache: GroupCache | None = None) -> None:
        world = world_size if world_size is not None else dist.get_world_size()
        if max_degree < 1 or max_degree & (max_degree - 1) or max_degree > world:
            raise PlanError(
                f"flexsp max_degree={max_degree} must be a power of two <= world size {world}"
            )
        self.world_size = world
        self.max_degree = max_degree
        self._cache = cache or GroupCache()
        self._groups: dict[tuple[int, int], dist.ProcessGroup | None] = {}
        degree = 2
        while degree <= max_degree:
            for start in range(0, world - degree + 1, degree):
                ranks = list(range(start, start + degree))
                self._groups[(start, degree)] = self._cache.get(ranks)
            degree *= 2

    def get(self, start_rank: int, degree: int) -> dist.ProcessGroup | None:
        """The group over [start_rank, start_rank + degree); None for degree 1 (no comm) or
        when this rank is not a member."""
        if degree == 1:
            return None
        key = (start_rank, degree)
        if key not in self._groups:
            raise PlanError(
                f"flexsp group at rank {start_rank} of degree {degree} is not an aligned power of "
                f"two <= max_degree={self.max_degree}; re-plan with that max degree"
            )
        return self._groups[key]

    @property
    def num_communicators(self) -> int:
        """Distinct rank sets created (including ones this rank is not in)."""
        return len(self._groups)
