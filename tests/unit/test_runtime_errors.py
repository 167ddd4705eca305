"""`build_model` rejects plans it cannot run with one-line PlanErrors, before any group exists."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from megatron_ext.errors import PlanError
from megatron_ext.plan import FlexSPConfig, LayerStrategy, ParallelPlan
from megatron_ext.presets import MODEL_PRESETS


def _plan(layers: list[LayerStrategy], world: int = 4, **kw: object) -> ParallelPlan:
    return ParallelPlan(world_size=world, pp=1, stages=((0, 4),), layers=tuple(layers),
                        model=MODEL_PRESETS["tiny-llama"], micro_batch_size=4,
                        global_batch_size=8, seq_length=32, precision="fp32",
                        **kw)  # type: ignore[arg-type]


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_zero_2_and_3_are_runtime_plans() -> None:
    """Per-layer ZeRO-2/3 run on the layerwise runtime (parity: tests/dist/test_runtime_zero.py);
    zero outside 0-3 is a one-line plan error."""
    from megatron_ext.megatron_adapter.build import check_runtime_support

    plan = _plan([LayerStrategy(dp=4, zero=z) for z in (0, 1, 2, 3)])
    check_runtime_support(plan, embedding=True, output_layer=True)
    assert ParallelPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(PlanError) as err:
        LayerStrategy(dp=4, zero=4)
    assert "zero=4 must be 0 (DDP), 1 (distributed optimizer), 2" in _one_line(err)


def test_fp16_is_supported() -> None:
    """fp16 runs on the layerwise runtime (tests/dist/test_runtime_fp16.py: loss-scale parity)."""
    from megatron_ext.megatron_adapter.build import check_runtime_support

    plan = dataclasses.replace(_plan([LayerStrategy(dp=4, zero=z) for z in (0, 1, 2, 3)]),
                               precision="fp16")
    check_runtime_support(plan, embedding=True, output_layer=True)


def test_flexsp_plan_is_a_plan_error() -> None:
    from megatron_ext.megatron_adapter.build import build_model

    plan = _plan([LayerStrategy(dp=4)] * 4, flexsp=FlexSPConfig(max_group_size=4))
    with pytest.raises(PlanError, match="flexsp"):
        build_model(plan)


def test_config_mismatch_is_a_plan_error() -> None:
    from megatron_ext.megatron_adapter.build import build_model
    from megatron_ext.megatron_adapter.transformer_config import transformer_config

    plan = _plan([LayerStrategy(tp=2, dp=2)] * 4)
    config = transformer_config(dataclasses.replace(plan.model, hidden_size=128))
    with pytest.raises(PlanError) as err:
        build_model(plan, config)
    assert "hidden_size=128 but the plan was made for model.hidden_size=64" in _one_line(err)


def test_world_mismatch_fails_before_any_group() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_ext.megatron_adapter.build import build_model

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        groups_before = dist.distributed_c10d._world.group_count
        plan = _plan([LayerStrategy(tp=2, dp=4)] * 4, world=8)
        with pytest.raises(PlanError) as err:
            build_model(plan)
        assert "plan.world_size=8 but 4 processes were launched" in _one_line(err)
        assert dist.distributed_c10d._world.group_count == groups_before
    finally:
        dist.destroy_process_group()
