"""Rank arithmetic of layouts and plan groups; group construction at world size 64 on `fake`.

The fake backend creates groups instantly and its collectives are no-ops, so it checks which
rank sets exist and who belongs to them, never numerics.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch.distributed as dist

from megatron_ext.errors import PlanError
from megatron_ext.geometry.activation import ActivationLayout
from megatron_ext.geometry.stages import embedding_layout, output_layout
from megatron_ext.plan import LayerStrategy, ParallelPlan
from megatron_ext.presets import MODEL_PRESETS
from megatron_ext.runtime.groups import (
    AXES,
    build_plan_groups,
    check_world_size,
    layout_rank_sets,
    plan_rank_sets,
)


def all_layouts(width: int) -> list[ActivationLayout]:
    """Every layout of `width` ranks (with and without sp)."""
    found = []
    for tp, ulysses, cp in itertools.product(range(1, width + 1), repeat=3):
        if width % (tp * ulysses * cp):
            continue
        dp = width // (tp * ulysses * cp)
        for sp in (False, True) if tp > 1 else (False,):
            found.append(ActivationLayout(tp=tp, sp=sp, cp=cp, ulysses=ulysses, dp=dp))
    return found


@pytest.mark.parametrize("width", [4, 8, 12])
def test_layout_blocks_partition_the_activation(width: int) -> None:
    seq_length, batch = 48, 12
    for layout in all_layouts(width):
        if seq_length % layout.seq_chunks() or batch % layout.dp:
            continue
        owner: dict[tuple[int, int], int] = {}
        for local in range(width):
            coords = layout.coords(local)
            assert layout.rank_of(coords) == local
            positions = layout.positions(local, seq_length)
            lo, hi = layout.batch_range(local, batch)
            assert (len(positions), hi - lo) == layout.local_shape(seq_length, batch)
            block = min(layout.replicas(local))
            for cell in itertools.product(positions, range(lo, hi)):
                assert owner.setdefault(cell, block) == block, (layout, local, cell)
        # every (position, sample) is held by exactly one replica class
        assert len(owner) == seq_length * batch, layout


def test_layout_rank_order_is_megatron_tp_innermost() -> None:
    layout = ActivationLayout(tp=2, ulysses=2, cp=2, dp=2)
    assert layout_rank_sets(layout, "tp") == [(2 * i, 2 * i + 1) for i in range(8)]
    assert layout_rank_sets(layout, "ulysses")[0] == (0, 2)
    assert layout_rank_sets(layout, "cp")[0] == (0, 4)
    assert layout_rank_sets(layout, "dp")[0] == (0, 8)
    assert layout_rank_sets(layout, "dp_cp")[0] == tuple(range(0, 16, 2))
    # cp rank 1 of cp2 holds the load-balanced chunks 1 and 2 of 4
    assert ActivationLayout(cp=2).chunk_ids(1) == (1, 2)
    # cp rank 1 holds tokens [2, 6); SP gives tp rank 1 the second half
    assert ActivationLayout(cp=2, tp=2, sp=True).positions(3, 8) == [4, 5]


def _plan(world: int, pp: int, strategies: list[LayerStrategy], **kw: object) -> ParallelPlan:
    model = MODEL_PRESETS["tiny-gpt"]
    model = type(model)(**{**model.to_dict(), "num_layers": len(strategies),
                           "num_attention_heads": 16, "num_query_groups": 16, "hidden_size": 256})
    n = len(strategies)
    stages = tuple((i * n // pp, (i + 1) * n // pp) for i in range(pp))
    return ParallelPlan(world_size=world, pp=pp, stages=stages, layers=tuple(strategies),
                        model=model, micro_batch_size=32, global_batch_size=64, seq_length=64,
                        precision="fp32", **kw)  # type: ignore[arg-type]


@pytest.fixture
def fake_world() -> object:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int, world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_groups_at_world_64_share_communicators(fake_world) -> None:
    a = LayerStrategy(tp=8, dp=4)
    b = LayerStrategy(tp=4, sp=True, cp=2, dp=4)
    c = LayerStrategy(tp=1, ulysses=2, dp=16)
    plan = _plan(64, 2, [a, b, a, b, c, c, a, b])
    rank = 37  # stage 1, local 5
    fake_world(rank, 64)
    groups = build_plan_groups(plan)
    distinct = set(plan_rank_sets(plan))
    assert groups.num_groups == len(distinct)
    assert (groups.stage, groups.local_rank) == (1, 5)
    assert dist.get_process_group_ranks(groups.pp) == [5, 37]
    assert dist.get_process_group_ranks(groups.embd) == [5, 37]
    assert dist.get_process_group_ranks(groups.stage_group) == list(range(32, 64))
    la = groups.for_layer(6)
    assert dist.get_process_group_ranks(la.tp) == list(range(32, 40))
    assert dist.get_process_group_ranks(la.dp) == [37, 45, 53, 61]
    lb = groups.for_layer(7)
    assert dist.get_process_group_ranks(lb.tp) == [36, 37, 38, 39]
    assert dist.get_process_group_ranks(lb.cp) == [33, 37]
    assert dist.get_process_group_ranks(lb.dp) == [37, 45, 53, 61]
    # equal rank sets are one communicator, across layouts and axes
    assert la.dp is lb.dp
    assert groups.for_layer(4) is groups.for_layer(5)
    lc = groups.for_layer(4)
    assert dist.get_process_group_ranks(lc.ulysses) == [36, 37]
    assert lc.tp is groups.singleton and lc.cp is groups.singleton
    assert dist.get_process_group_ranks(lc.dp_cp) == list(range(32, 64))


def test_every_rank_creates_the_same_sets(fake_world) -> None:
    plan = _plan(16, 2, [LayerStrategy(tp=2, dp=4), LayerStrategy(tp=4, cp=2)] * 2)
    fake_world(3, 16)
    groups = build_plan_groups(plan)
    expected = len(set(plan_rank_sets(plan)))
    assert groups.num_groups == expected
    for layout, lg in groups.layouts.items():
        for axis in AXES:
            members = dist.get_process_group_ranks(getattr(lg, axis))
            assert 3 in members and members == sorted(members), (layout, axis)


def test_world_mismatch_is_one_line_plan_error() -> None:
    plan = _plan(8, 1, [LayerStrategy(tp=2, dp=4)] * 2)
    with pytest.raises(PlanError, match="plan.world_size=8 but 4 processes"):
        check_world_size(plan, 4)


def test_vocab_layouts_follow_neighbour_or_split_tokens() -> None:
    from megatron_ext.plan import VocabStrategy

    layers = [LayerStrategy(tp=2, dp=4), LayerStrategy(tp=8), LayerStrategy(tp=8),
              LayerStrategy(tp=8)]
    plan = _plan(8, 1, layers, vocab=VocabStrategy(tp=2))
    assert embedding_layout(plan) == ActivationLayout(tp=2, dp=4)  # the first layer's own layout
    assert output_layout(plan) == ActivationLayout(tp=2, dp=4)  # pp=1: shares the embedding's sp
    plan = _plan(16, 2, [LayerStrategy(tp=8)] * 4, vocab=VocabStrategy(tp=2))
    assert output_layout(plan) == ActivationLayout(tp=2, sp=True, dp=4)  # mbs 32 splits over all 4
    plan = dataclasses.replace(plan, micro_batch_size=2, global_batch_size=4)
    # the rest split by sequence
    assert output_layout(plan) == ActivationLayout(tp=2, sp=True, ulysses=2, dp=2)
