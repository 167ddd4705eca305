"""Resume matrix: train under plan A, save (weights, Adam moments, step, scheduler), resume under
plan B, and compare every later loss with a run of A that never stopped.

Each chain below trains its first plan for 2 steps, saves, and keeps training uninterrupted for
the reference losses; every later plan is built with other initial weights, loads the latest
checkpoint, trains 2 steps (compared with the reference) and saves for the next one. fp32, the
layerwise runtime's checkpoint.py path (the stock and FlexSP backends: test_checkpoint_formats).

Tolerance: rel 1e-5 per loss. Only reduction orders differ between the plans (FSDP2
reduce-scatters vs DDP all-reduces vs distributed-optimizer buckets, TP partial sums, expert
all-to-alls over other groups): ~1e-7 relative per step, compounding over a few steps. A lost or
misplaced Adam moment changes the next loss by >1e-3 relative: the control case loads the same
checkpoint with load_optimizer=False and must differ by more than 1e-4. Resuming under the
same plan is bit for bit.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest

from megatron_ext.plan import LayerStrategy as L
from megatron_ext.plan import VocabStrategy as V
from megatron_ext.runtime.testing import run_distributed

pytestmark = pytest.mark.dist

REL = 1e-5  # see the module docstring
CONTROL_REL = 1e-4
STEPS = 2
CONTROL = "ZeRO-3 -> ZeRO-1 -> heterogeneous ZeRO-3/ZeRO-2 tp2 -> ZeRO-0"


def _models() -> dict[str, Any]:
    from megatron_ext.presets import MODEL_PRESETS
    from megatron_ext.specs import MoESpec

    llama = MODEL_PRESETS["tiny-llama"]
    moe = MoESpec(num_experts=4, router_topk=2, ffn_hidden_size=96, aux_loss_coeff=0.01)
    return {"llama": llama, "llama8": dataclasses.replace(llama, num_layers=8),
            "moe": dataclasses.replace(llama, name="tiny-moe", moe=moe)}


def chains_4() -> dict[str, list]:
    """name -> plans, each resuming the previous one's checkpoint (4 ranks)."""
    from tests.dist.runtime_parity import make_plan

    m = _models()
    z3, z1 = make_plan(m["llama"], [L(dp=4, zero=3)] * 4), make_plan(m["llama"],
                                                                      [L(dp=4, zero=1)] * 4)
    return {
        # ZeRO-3 -> ZeRO-1 and back (layers 0-1), to ZeRO-2 (2-3), heterogeneous -> uniform,
        # ZeRO-2 -> ZeRO-0
        CONTROL: [
            z3, z1,
            make_plan(m["llama"], [L(tp=2, dp=2, zero=3)] * 2 + [L(tp=2, sp=True, dp=2, zero=2)]
                      * 2, vocab=V(tp=2)),
            make_plan(m["llama"], [L(dp=4)] * 4)],
        "EP 2 -> EP 4": [make_plan(m["moe"], [L(dp=4, ep=2)] * 4),
                         make_plan(m["moe"], [L(dp=4, ep=4)] * 4)],
        "pp2 vpp2 -> pp4": [
            make_plan(m["llama8"], [L(dp=2)] * 8, pp=2, num_mb=4, virtual_stages=2,
                      stages=[(2 * j, 2 * j + 2) for j in range(4)]),
            make_plan(m["llama8"], [L()] * 8, pp=4, num_mb=4,
                      stages=[(2 * j, 2 * j + 2) for j in range(4)])],
        "vocabulary-parallel -> tensor-parallel vocabulary": [
            make_plan(m["llama"], [L(dp=2), L(tp=2, sp=True), L(tp=2), L(dp=2, zero=1)], pp=2,
                      stages=[(0, 2), (2, 4)], num_mb=3,
                      vocab=V(mode="vocab_parallel", tp=2, algorithm=2)),
            make_plan(m["llama"], [L(tp=2, dp=2)] * 4, num_mb=3, vocab=V(tp=2))],
    }


def world_change() -> tuple[Any, Any]:
    """A 4-rank plan and the 2-rank plan that resumes it."""
    from tests.dist.runtime_parity import make_plan

    llama = _models()["llama"]
    return (make_plan(llama, [L(tp=2, dp=2, zero=1)] * 2 + [L(dp=4, zero=3)] * 2),
            make_plan(llama, [L(dp=2, zero=3)] * 2 + [L(tp=2)] * 2, world=2))


def _trainer(plan: Any, seed: int) -> tuple[Any, Any]:
    """The plan's backend and a constant-lr scheduler, as training holds them."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_ext.megatron_adapter.transformer_config import (
        ModelOptions,
        transformer_config,
    )
    from tests.dist.runtime_parity import LR, WEIGHT_DECAY, layerwise_backend

    config = None
    if plan.model.moe is not None:
        config = transformer_config(plan.model, precision="fp32",
                                    options=ModelOptions(moe_token_dispatcher_type="alltoall"))
    backend = layerwise_backend(plan, seed=seed, config=config)
    scheduler = OptimizerParamScheduler(
        backend.optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0,
        lr_decay_steps=100, lr_decay_style="constant", start_wd=WEIGHT_DECAY,
        end_wd=WEIGHT_DECAY, wd_incr_steps=100, wd_incr_style="constant")
    return backend, scheduler


def _train(backend: Any, scheduler: Any, plan: Any, steps: int) -> list[float]:
    from megatron_ext.megatron_adapter.training.loop import train_step
    from tests.dist.runtime_parity import make_batches, rank_rows

    micro = make_batches(plan, 1, seed=3)[0]
    losses = []
    for _ in range(steps):
        losses.append(train_step(backend, rank_rows(backend, micro)).loss)
        scheduler.step(increment=plan.global_batch_size)
    return losses


def _resume(plan: Any, path: str, *, load_optimizer: bool = True) -> tuple[Any, Any, int]:
    from megatron_ext.megatron_adapter.training.checkpoint import load_checkpoint
    from megatron_ext.megatron_adapter.training.checkpoint_files import resolve_load

    backend, scheduler = _trainer(plan, seed=5)  # other initial weights: all must come back
    state = load_checkpoint(resolve_load(path), backend, scheduler, plan,
                            load_optimizer=load_optimizer)
    return backend, scheduler, state.iteration


def _save(backend: Any, scheduler: Any, plan: Any, path: str, iteration: int) -> None:
    from megatron_ext.megatron_adapter.training.checkpoint import TrainState, save_checkpoint

    save_checkpoint(path, backend, scheduler, TrainState(iteration=iteration), plan)


def _chain(plans: list, path: str, *, control: bool = False) -> dict[str, Any]:
    """plans[0]: 2 steps, save, then uninterrupted to the end (expected); each later plan
    resumes the latest checkpoint for 2 steps and saves."""
    first = plans[0]
    backend, scheduler = _trainer(first, seed=11)
    _train(backend, scheduler, first, STEPS)
    _save(backend, scheduler, first, path, STEPS)
    expected = _train(backend, scheduler, first, STEPS * (len(plans) - 1))
    got, out = [], {}
    if control:  # the same plan resumed bit for bit; without the moments it is not the same
        backend, scheduler, _ = _resume(first, path)
        out["same_plan"] = _train(backend, scheduler, first, STEPS)
        backend, scheduler, _ = _resume(plans[1], path, load_optimizer=False)
        out["without_optimizer"] = _train(backend, scheduler, plans[1], STEPS)
    for plan in plans[1:]:
        backend, scheduler, iteration = _resume(plan, path)
        got += _train(backend, scheduler, plan, STEPS)
        _save(backend, scheduler, plan, path, iteration + STEPS)
    return {"expected": expected, "got": got, **out}


def _run_4(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from megatron_ext.megatron_adapter.training.checkpoint import prewarm_checkpoint_writer

    warnings.filterwarnings("ignore")
    prewarm_checkpoint_writer()  # the writer's first use costs seconds: overlap the builds
    out = {}
    for i, (name, plans) in enumerate(chains_4().items()):
        out[name] = _chain(plans, f"{root}/chain{i}", control=i == 0)
    first, _ = world_change()
    backend, scheduler = _trainer(first, seed=11)
    _train(backend, scheduler, first, STEPS)
    _save(backend, scheduler, first, f"{root}/world", STEPS)
    out["4 ranks -> 2 ranks"] = {"expected": _train(backend, scheduler, first, STEPS)}
    return out


def _run_2(rank: int, world_size: int, root: str) -> list[float]:
    warnings.filterwarnings("ignore")
    _, plan = world_change()
    backend, scheduler, _ = _resume(plan, f"{root}/world")
    return _train(backend, scheduler, plan, STEPS)


def _close(got: list[float], expected: list[float], rel: float) -> bool:
    return len(got) == len(expected) and all(
        abs(g - e) <= rel * abs(e) for g, e in zip(got, expected))


def test_resume_matrix(tmp_path) -> None:
    """Every chain continues its uninterrupted losses within REL, in one 4-rank and one 2-rank
    spawn; the same plan resumes bit for bit; dropping the moments is detected."""
    results = run_distributed(_run_4, world_size=4, timeout_s=900, root=str(tmp_path))[0]
    world = results.pop("4 ranks -> 2 ranks")
    world["got"] = run_distributed(_run_2, world_size=2, timeout_s=600, root=str(tmp_path))[0]
    results["4 ranks -> 2 ranks"] = world
    failed = {name: r for name, r in results.items()
              if not _close(r["got"], r["expected"], REL)}
    assert not failed, failed
    control = results[CONTROL]
    assert control["same_plan"] == control["expected"][:STEPS], control
    assert not _close(control["without_optimizer"], control["expected"][:STEPS], CONTROL_REL), \
        control
