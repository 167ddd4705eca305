"""Process groups of a ParallelPlan: one communicator per distinct rank set, shared by all layers.

Legend: S = ranks per pipeline stage; local rank = rank % S; layouts as in geometry/activation.py
(tp innermost, then ulysses, cp, dp; pipeline stages outermost, as Megatron's
`tp-cp-ep-dp-pp` order with Ulysses beside cp).

`torch.distributed.new_group` is collective over the whole world, so every rank builds the same
ordered list of rank sets from the plan alone and creates each missing set once, in that order;
a rank keeps the handles of the groups it belongs to. Layers whose layouts share a rank set
share the communicator (e.g. the dp group of `tp1 dp4` is the dp_cp group of `tp1 cp2 dp2`).
Nothing here imports megatron; `megatron_adapter/pg.py` wraps the result in
`ProcessGroupCollection`s.

Mixture-of-Experts layers add, per layout, the token-block group `tp_cp` (tp x Ulysses x cp:
the ranks holding one block of tokens, over which the router sums its expert counts), and per
(ep, etp) of the stage's MoE layers the expert groups of Megatron's expert rank generator (order
etp, ep, expert-dp inside the stage, independent of the attention layout as in megatron-core's
MoE parallel folding): `expt_tp`, `ep`, `tp_ep` and `expt_dp`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch.distributed as dist

from megatron_ext.errors import PlanError
from megatron_ext.geometry.activation import ActivationLayout
from megatron_ext.geometry.stages import stage_layouts, stage_of_rank
from megatron_ext.plan import ParallelPlan

__all__ = [
    "AXES",
    "GroupCache",
    "LayoutGroups",
    "PlanGroups",
    "build_plan_groups",
    "check_world_size",
    "ExpertGroups",
    "expert_rank_sets",
    "layout_rank_sets",
    "plan_rank_sets",
]

Axis = Literal["tp", "ulysses", "cp", "dp", "dp_cp", "tp_cp", "stage"]
AXES: tuple[Axis, ...] = ("tp", "ulysses", "cp", "dp", "dp_cp")
"""Per-layout group axes. dp_cp = every rank of the stage with the same tp rank: the ranks that
hold replicas of a tensor-parallel parameter shard (dp x cp x ulysses), i.e. its gradient group."""

RankSet = tuple[int, ...]


def layout_rank_sets(layout: ActivationLayout, axis: Axis, offset: int = 0) -> list[RankSet]:
    """Partition of the stage's ranks [offset, offset + width) into groups along `axis`."""
    width = layout.width
    if axis == "stage":
        return [tuple(range(offset, offset + width))]
    varying = {"tp": ("tp",), "ulysses": ("ulysses",), "cp": ("cp",), "dp": ("dp",),
               "dp_cp": ("ulysses", "cp", "dp"), "tp_cp": ("tp", "ulysses", "cp")}[axis]
    groups: dict[tuple[int, ...], list[int]] = {}
    for local in range(width):
        coords = layout.coords(local)._asdict()
        key = tuple(v for k, v in coords.items() if k not in varying)
        groups.setdefault(key, []).append(offset + local)
    return sorted(tuple(g) for g in groups.values())


ExpertAxis = Literal["expt_tp", "ep", "tp_ep", "expt_dp"]
EXPERT_AXES: tuple[ExpertAxis, ...] = ("expt_tp", "ep", "tp_ep", "expt_dp")


def expert_rank_sets(width: int, ep: int, etp: int, axis: ExpertAxis,
                     offset: int = 0) -> list[RankSet]:
    """Partition of the stage ranks [offset, offset + width) along an expert axis: local rank r
    has expert-tp rank r % etp, ep rank (r // etp) % ep, expert-dp rank r // (etp * ep)."""
    varying = {"expt_tp": ("t",), "ep": ("e",), "tp_ep": ("t", "e"), "expt_dp": ("d",)}[axis]
    groups: dict[tuple[int, ...], list[int]] = {}
    for local in range(width):
        coords = {"t": local % etp, "e": (local // etp) % ep, "d": local // (etp * ep)}
        key = tuple(v for k, v in coords.items() if k not in varying)
        groups.setdefault(key, []).append(offset + local)
    return sorted(tuple(g) for g in groups.values())


def moe_layer_degrees(plan: ParallelPlan, stage: int) -> list[tuple[int, int]]:
    """Distinct (ep, expert tp) of the MoE layers of `stage` (all its chunks), in layer
    order."""
    return list(dict.fromkeys((plan.layers[i].ep, plan.layers[i].expert_tp)
                              for i in plan.stage_layers(stage) if plan.model.is_moe_layer(i)))


def moe_layouts(plan: ParallelPlan, stage: int) -> list[ActivationLayout]:
    """Distinct layouts of the MoE layers of `stage` (all its chunks)."""
    return list(dict.fromkeys(ActivationLayout.of(plan.layers[i]) for i in plan.stage_layers(stage)
                              if plan.model.is_moe_layer(i)))


def check_world_size(plan: ParallelPlan, world_size: int) -> None:
    """One-line PlanError when the launched world does not match the plan."""
    if world_size != plan.world_size:
        raise PlanError(
            f"plan.world_size={plan.world_size} but {world_size} processes were launched; "
            f"launch {plan.world_size} ranks or make a plan for {world_size}"
        )


def plan_rank_sets(plan: ParallelPlan) -> Iterator[RankSet]:
    """Every rank set the plan needs, in the canonical creation order (duplicates included)."""
    world = plan.world_size
    width = plan.stage_width
    yield from ((r,) for r in range(world))  # singletons first: every size-1 axis reuses them
    for stage in range(plan.pp):
        offset = stage * width
        yield from layout_rank_sets(ActivationLayout(dp=width), "stage", offset)
        for layout in stage_layouts(plan, stage):
            for axis in AXES:
                yield from layout_rank_sets(layout, axis, offset)
        for layout in moe_layouts(plan, stage):
            yield from layout_rank_sets(layout, "tp_cp", offset)
        for ep, etp in moe_layer_degrees(plan, stage):
            for expert_axis in EXPERT_AXES:
                yield from expert_rank_sets(width, ep, etp, expert_axis, offset)
    for local in range(width):
        yield tuple(local + stage * width for stage in range(plan.pp))  # pipeline groups
    if plan.pp > 1:
        for local in range(width):  # first and last stage: tied embedding / output weights
            yield (local, local + (plan.pp - 1) * width)


@dataclass
class GroupCache:
    """`new_group` once per distinct rank set. Every rank must call `get` in the same order."""

    backend: str | None = None
    """Backend for new groups; None = the default process group's."""
    _groups: dict[RankSet, dist.ProcessGroup | None] = field(default_factory=dict)

    def get(self, ranks: Sequence[int]) -> dist.ProcessGroup | None:
        """This rank's handle of the group over `ranks` (created on first use), else None."""
        key = tuple(ranks)
        if key not in self._groups:
            if len(key) == dist.get_world_size() and key == tuple(range(len(key))):
                group: dist.ProcessGroup | None = dist.group.WORLD
            else:
                group = dist.new_group(list(key), backend=self.backend)
            member = dist.get_rank() in key
            self._groups[key] = group if member else None
        return self._groups[key]

    @property
    def num_groups(self) -> int:
        """Distinct rank sets created so far (communicators, counting non-member sets)."""
        return len(self._groups)


@dataclass(frozen=True, kw_only=True)
class LayoutGroups:
    """This rank's groups for one layout of its stage."""

    layout: ActivationLayout
    tp: dist.ProcessGroup
    ulysses: dist.ProcessGroup
    """Ulysses group (the layout's contiguous sequence split)."""
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup
    """Gradient-reduction (and ZeRO sharding) group of this layout's parameters."""
    tp_cp: dist.ProcessGroup | None = None
    """MoE layouts: the ranks holding one block of tokens (tp x Ulysses x cp)."""


@dataclass(frozen=True, kw_only=True)
class ExpertGroups:
    """This rank's expert groups for MoE layers with (ep, etp) on its stage."""

    ep: int
    etp: int
    expt_tp: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    tp_ep: dist.ProcessGroup
    expt_dp: dist.ProcessGroup
    """Replicas of this rank's expert shards: their gradient-reduction group."""


@dataclass(frozen=True, kw_only=True)
class PlanGroups:
    """All groups this rank needs to run `plan`."""

    plan: ParallelPlan
    rank: int
    stage: int
    """This rank's pipeline stage."""
    local_rank: int
    """Rank inside the stage, the index all layouts use."""
    stage_group: dist.ProcessGroup
    """All S ranks of this stage (re-layouts between layers run over it)."""
    pp: dist.ProcessGroup
    embd: dist.ProcessGroup | None
    """First and last stage rank with this local rank (pp > 1), for tied embeddings."""
    singleton: dist.ProcessGroup
    layouts: dict[ActivationLayout, LayoutGroups]
    """Groups of every layout this stage uses."""
    num_groups: int
    """Distinct rank sets the plan created (the same number on every rank)."""
    experts: dict[tuple[int, int], ExpertGroups] = field(default_factory=dict)
    """(ep, expert tp) -> expert groups, for the MoE layers of this stage."""

    def for_layout(self, layout: ActivationLayout) -> LayoutGroups:
        return self.layouts[layout]

    def for_layer(self, layer_idx: int) -> LayoutGroups:
        assert layer_idx in self.plan.stage_layers(self.stage), (
            f"layer {layer_idx} is not on stage {self.stage}")
        return self.layouts[ActivationLayout.of(self.plan.layers[layer_idx])]


def build_plan_groups(plan: ParallelPlan, cache: GroupCache | None = None) -> PlanGroups:
    """Create (collectively, on every rank) and return this rank's groups for `plan`."""
    check_world_size(plan, dist.get_world_size())
    cache = cache or GroupCache()
    for ranks in plan_rank_sets(plan):
        cache.get(ranks)
    rank = dist.get_rank()
    stage, local = stage_of_rank(plan, rank)
    offset = stage * plan.stage_width

    def mine(sets: list[RankSet]) -> dist.ProcessGroup:
        (ranks,) = [s for s in sets if rank in s]
        group = cache.get(ranks)
        assert group is not None
        return group

    moe = set(moe_layouts(plan, stage))
    layouts = {
        layout: LayoutGroups(
            layout=layout,
            **{axis: mine(layout_rank_sets(layout, axis, offset)) for axis in AXES},
            tp_cp=mine(layout_rank_sets(layout, "tp_cp", offset)) if layout in moe else None,
        )
        for layout in stage_layouts(plan, stage)
    }
    width = plan.stage_width
    experts = {
        (ep, etp): ExpertGroups(
            ep=ep, etp=etp,
            **{("ep_group" if axis == "ep" else axis): mine(
                expert_rank_sets(width, ep, etp, axis, offset)) for axis in EXPERT_AXES})
        for ep, etp in moe_layer_degrees(plan, stage)
    }
    pp_ranks = [tuple(local + s * width for s in range(plan.pp))]
    embd = None
    if plan.pp > 1 and stage in (0, plan.pp - 1):
        embd = cache.get((local, local + (plan.pp - 1) * width))
    return PlanGroups(
        plan=plan, rank=rank, stage=stage, local_rank=local,
        stage_group=mine(layout_rank_sets(ActivationLayout(dp=width), "stage", offset)),
        pp=mine(pp_ranks), embd=embd, singleton=mine([(rank,)]), layouts=layouts,
        num_groups=cache.num_groups, experts=experts,
    )
