"""MoE pieces of the layerwise runtime that need no spawned ranks: expert rank arithmetic, the
expert groups on the `fake` backend, per-layer configs (expert degrees, router-loss
coefficients), expert names by global index, the optimizer-chain count checkpoints use, and the
one-line refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from megatron_ext.errors import PlanError
from megatron_ext.plan import LayerStrategy as L
from megatron_ext.plan import ParallelPlan
from megatron_ext.presets import MODEL_PRESETS
from megatron_ext.runtime.groups import build_plan_groups, expert_rank_sets
from megatron_ext.specs import MoESpec


def _model(layer_freq: int | tuple[int, ...] = 1, **moe: object):
    spec = MoESpec(num_experts=8, router_topk=2, ffn_hidden_size=96, aux_loss_coeff=0.01,
                   layer_freq=layer_freq, **moe)  # type: ignore[arg-type]
    return dataclasses.replace(MODEL_PRESETS["tiny-llama"], moe=spec)


def _plan(world: int, layers: list[L], *, pp: int = 1, model=None, **kw) -> ParallelPlan:
    n = len(layers)
    stages = tuple((s * n // pp, (s + 1) * n // pp) for s in range(pp))
    return ParallelPlan(world_size=world, pp=pp, stages=stages, layers=tuple(layers),
                        model=model or _model(), micro_batch_size=8, global_batch_size=16,
                        seq_length=32, precision="fp32", **kw)


def test_expert_rank_sets_follow_megatrons_expert_order() -> None:
    # 8 ranks, ep=2, etp=2: expert-tp innermost, then ep, then expert-dp (parallel_state.py)
    assert expert_rank_sets(8, 2, 2, "expt_tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert expert_rank_sets(8, 2, 2, "ep") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert expert_rank_sets(8, 2, 2, "tp_ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert expert_rank_sets(8, 2, 2, "expt_dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert expert_rank_sets(4, 4, 1, "expt_dp", offset=4) == [(4,), (5,), (6,), (7,)]


@pytest.fixture
def fake_world() -> object:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int, world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_expert_groups_per_stage_and_token_blocks(fake_world) -> None:
    plan = _plan(16, [L(tp=2, cp=2, dp=2), L(tp=2, sp=True, dp=4, ep=4, etp=1),
                      L(dp=8, ep=2), L(tp=2, sp=True, dp=4, ep=4, etp=1)],
                 pp=2, model=_model((0, 1, 1, 1)))
    fake_world(13, 16)  # stage 1, local rank 5
    groups = build_plan_groups(plan)
    assert set(groups.experts) == {(2, 1), (4, 1)}

    def ranks(group: dist.ProcessGroup) -> list[int]:
        return dist.get_process_group_ranks(group)

    ep2, ep4 = groups.experts[(2, 1)], groups.experts[(4, 1)]
    assert ranks(ep2.ep_group) == [12, 13] and ranks(ep2.expt_dp) == [9, 11, 13, 15]
    assert ranks(ep4.ep_group) == [12, 13, 14, 15] and ranks(ep4.expt_dp) == [9, 13]
    assert ranks(ep4.expt_tp) == [13]
    # token blocks: the tp2 x sp layer's block is its tp pair; the dp8 layer's a single rank
    assert ranks(groups.for_layer(3).tp_cp) == [12, 13]
    assert ranks(groups.for_layer(2).tp_cp) == [13]


def test_layer_configs_carry_expert_degrees_and_block_scaled_router_losses() -> None:
    from megatron_ext.megatron_adapter.layers import layer_config
    from megatron_ext.megatron_adapter.transformer_config import transformer_config

    model = _model(z_loss_coeff=0.001)
    base = transformer_config(model, calculate_per_token_loss=True)
    assert (base.num_moe_experts, base.moe_router_topk, base.moe_ffn_hidden_size) == (8, 2, 96)
    assert base.moe_token_dispatcher_type == "allgather"  # Megatron-LM's default
    cfg = layer_config(base, L(tp=2, sp=True, cp=2, dp=2, ep=4, etp=1))
    assert (cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (4, 1)
    # the router's counts are summed over tp x cp = 4 ranks: coefficients x 4, unless the
    # router weighs by that group itself (megatron-core 0.19)
    from megatron_ext.megatron_adapter.compat import router_weighs_the_token_block
    block = 1 if router_weighs_the_token_block() else 4
    assert cfg.moe_aux_loss_coeff == pytest.approx(0.01 * block)
    assert cfg.moe_z_loss_coeff == pytest.approx(0.001 * block)
    dense = layer_config(transformer_config(MODEL_PRESETS["tiny-llama"]), L(tp=2))
    assert dense.num_moe_experts is None and dense.expert_model_parallel_size == 1
    glob = transformer_config(_model(router_load_balancing_type="global_aux_loss"))
    cfg = layer_config(glob, L(tp=2, sp=True, dp=4, ep=2))  # summed over the 8-rank stage
    # x 8, or x 8 / (tp x cp = 2) when the router weighs by its tp_cp group (0.19)
    assert cfg.moe_aux_loss_coeff == pytest.approx(0.04 if block == 1 else 0.08)


def test_expert_module_names_become_global() -> None:
    from megatron_ext.megatron_adapter.weights import _global_module_name

    offsets = {"decoder.layers.3.mlp": [4, 5]}
    name = "decoder.layers.3.mlp.experts.local_experts.1.linear_fc1"
    assert _global_module_name(name, offsets) == "decoder.layers.3.mlp.experts.local_experts.5." \
        "linear_fc1"
    assert _global_module_name("decoder.layers.3.mlp.router", offsets) == \
        "decoder.layers.3.mlp.router"


def test_optimizer_chain_counts_expert_classes() -> None:
    from megatron_ext.megatron_adapter.training.checkpoint import gradient_class_counts

    uniform = _plan(4, [L(dp=4, ep=2)] * 4)
    assert gradient_class_counts(uniform) == (2,)  # dense (embedding, layers, head) + experts
    # the chain length does not depend on ep: EP2 checkpoints reload under EP4 with optimizer
    assert gradient_class_counts(_plan(4, [L(dp=4, ep=4)] * 4)) == (2,)
    mixed = _plan(4, [L(dp=4), L(dp=4, ep=2), L(dp=4), L(dp=4, ep=4, zero=1)],
                  model=_model((0, 1, 0, 1)))
    assert gradient_class_counts(mixed) == (4,)  # dense z0, dense z1, experts ep2, ep4/z1


@pytest.mark.parametrize(("layers", "kw", "expected"), [
    ([L(dp=4, ep=2, zero=2)] * 4, {}, "zero=2"),
    ([L(dp=4, ep=2)] * 4, {"router_enable_expert_bias": True}, "expert-bias"),
])
def test_moe_runtime_refusals(layers: list[L], kw: dict, expected: str) -> None:
    from megatron_ext.megatron_adapter.build import check_moe_support

    model = _model(router_score_function="sigmoid", **kw) if kw else _model()
    with pytest.raises(PlanError, match=expected) as err:
        check_moe_support(_plan(4, layers, model=model))
    assert "\n" not in str(err.value)


def test_grouped_gemm_refused_without_kernels() -> None:
    from megatron_ext.megatron_adapter.build import check_moe_support
    from megatron_ext.megatron_adapter.transformer_config import (
        ModelOptions,
        transformer_config,
    )

    plan = _plan(4, [L(dp=4, ep=2)] * 4)
    config = transformer_config(plan.model, options=ModelOptions(moe_grouped_gemm=True))
    with pytest.raises(PlanError, match="--moe-grouped-gemm needs Transformer Engine"):
        check_moe_support(plan, config)
