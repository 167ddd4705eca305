"""Resume matrix: train under plan A, save (weights, Adam moments, step, scheduler), resume under
plan B, and compare every later loss with a run of A that never stopped.

Each chain below trains its first plan for 2 steps, saves, and keeps training uninterrupted
for the reference losses; every later plan is built with other initial weights, loads the
latest checkpoint, trains 2 steps (compared with the reference) and saves for the next one.
fp32 (one chain fp16, for the master copies and the loss scaler), the layerwise runtime's
checkpoint.py path (the stock and FlexSP backends:
test_checkpoint_formats). A checkpoint in the layout written before (megatron-core's chained
optimizer state) still resumes under the plan that wrote it, bit for bit.

Tolerance: rel 1e-5 per loss. Only reduction orders differ between the plans (FSDP2
reduce-scatters vs DDP all-reduces vs distributed-optimizer buckets, TP partial sums, expert
all-to-alls over other groups): ~1e-7 relative per step, compounding over a few steps. A lost or
misplaced Adam moment changes the next loss by >1e-3 relative: the control case loads the same
checkpoint with load_optimizer=False and must differ by more than 1e-4. Resuming under the
same plan is bit for bit.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
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
FP16 = "fp16, pp2, ZeRO 3/0 | 2/1 -> same plan -> ZeRO 1/1 | 3/0"


def fp16_plan() -> Any:
    from tests.dist.test_runtime_fp16 import _plan

    return _plan()  # pp2, stage 0: ZeRO-3 tp2 + DDP dp2, stage 1: ZeRO-2 tp2 + ZeRO-1 tp2+sp


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
    fp16 = fp16_plan()
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
        # fp16: fp32 master copies, moments and the loss scaler; the same plan first (its
        # losses bit for bit, checked in the test), then the ZeRO levels swapped
        FP16: [fp16, fp16, dataclasses.replace(fp16, layers=(
            L(tp=2, zero=1), L(tp=2, zero=1), L(dp=2, zero=3), L(tp=2)))],
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
    opt = None
    if plan.precision == "fp16":  # the dynamic loss scaler of test_runtime_fp16
        from tests.dist.test_runtime_fp16 import _opt_config

        opt = _opt_config(plan)
    backend = layerwise_backend(plan, seed=seed, config=config, opt=opt)
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
    _save_legacy(backend, scheduler, first, f"{root}/legacy", STEPS)
    out["4 ranks -> 2 ranks"] = {"expected": _train(backend, scheduler, first, STEPS)}
    backend, scheduler, _ = _resume(first, f"{root}/legacy")
    out["legacy"] = {"expected": out["4 ranks -> 2 ranks"]["expected"],
                     "got": _train(backend, scheduler, first, STEPS)}
    return out


def _save_legacy(backend: Any, scheduler: Any, plan: Any, path: str, iteration: int) -> None:
    """A checkpoint as megatron_ext wrote it before optimizer state was keyed by parameter:
    megatron-core's chained optimizer layout, and the record without `optimizer_layout`."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_ext.megatron_adapter.ddp import chain_kinds
    from megatron_ext.megatron_adapter.training import checkpoint as ckpt
    from megatron_ext.megatron_adapter.training.checkpoint_files import write_manifest
    from megatron_ext.megatron_adapter.training.checkpoint_legacy import optimizer_format
    from megatron_ext.megatron_adapter.training.checkpoint_optim import materialize_state

    materialize_state(backend.optimizer)
    sd = ckpt._state_dict(backend, scheduler, ckpt.TrainState(iteration=iteration), plan,
                          is_loading=False, optimizer="legacy")
    record = sd["megatron_ext"]
    del record["optimizer_layout"]
    record["optimizer_format"] = optimizer_format(backend.optimizer)
    record["optimizer_chain"] = [list(k) for k in chain_kinds(plan)]
    directory = Path(path) / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        directory.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(sd, str(directory))
    dist.barrier()
    if dist.get_rank() == 0:
        write_manifest(directory, iteration)
        (Path(path) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()


def _run_2(rank: int, world_size: int, root: str) -> list[float]:
    warnings.filterwarnings("ignore")
    _, plan = world_change()
    backend, scheduler, _ = _resume(plan, f"{root}/world")
    return _train(backend, scheduler, plan, STEPS)


def _close(got: list[float], expected: list[float], rel: float) -> bool:
    return len(got) == len(expected) and all(
        abs(g - e) <= rel * abs(e) for g, e in zip(got, expected))


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One 4-rank spawn for every chain, one 2-rank spawn for the world-size change."""
    root = tmp_path_factory.mktemp("resume_matrix")
    results = run_distributed(_run_4, world_size=4, timeout_s=900, root=str(root))[0]
    world = results.pop("4 ranks -> 2 ranks")
    world["got"] = run_distributed(_run_2, world_size=2, timeout_s=600, root=str(root))[0]
    results["4 ranks -> 2 ranks"] = world
    return results, root


def test_resume_matrix(matrix: tuple[dict[str, Any], Path]) -> None:
    """Every chain continues its uninterrupted losses within REL; the same plan resumes bit
    for bit (fp32 and fp16, and from the old layout); dropping the moments is detected."""
    results, _ = matrix
    failed = {name: r for name, r in results.items()
              if not _close(r["got"], r["expected"], REL)}  # (legacy too: checked exactly below)
    assert not failed, failed
    fp16 = results[FP16]  # master copies and loss scale restored: the same plan bit for bit
    assert fp16["got"][:STEPS] == fp16["expected"][:STEPS], fp16
    legacy = results["legacy"]  # the old layout, same plan: bit for bit
    assert legacy["got"] == legacy["expected"], legacy
    control = results[CONTROL]
    assert control["same_plan"] == control["expected"][:STEPS], control
    assert not _close(control["without_optimizer"], control["expected"][:STEPS], CONTROL_REL), \
        control


def test_legacy_checkpoint_under_another_chain_is_one_line(
        matrix: tuple[dict[str, Any], Path]) -> None:
    """The old layout reloads only into the same chains of optimizers: another plan is refused
    before any process group, naming --no-load-optim."""
    from megatron_ext.errors import PlanError
    from megatron_ext.megatron_adapter.training.checkpoint import (
        check_optimizer_layout,
        checkpoint_info,
    )

    _, root = matrix
    first, _ = world_change()
    info = checkpoint_info(root / "legacy")
    check_optimizer_layout(info, first, root / "legacy")  # the plan that wrote it: loads
    other = dataclasses.replace(first, layers=(L(dp=4),) * 4)
    with pytest.raises(PlanError, match="add --no-load-optim"):
        check_optimizer_layout(info, other, root / "legacy")


def test_checkpoint_inspect(matrix: tuple[dict[str, Any], Path]) -> None:
    """`megatron-ext checkpoint inspect` on the last save of the ZeRO chain (no process group),
    on a damaged copy, and on a directory that is no checkpoint (one line, exit 2)."""
    from megatron_ext.commands.checkpoint import inspect_checkpoint

    _, root = matrix
    chain = root / "chain0"  # 4 plans: saves at 2, 4, 6, 8; the last under plain dp4
    record = inspect_checkpoint(chain)
    assert record["iteration"] == record["tracker_iteration"] == 8, record
    assert record["intact"] and record["manifest"], record
    assert record["megatron_core_version"] == "0.16.1", record
    assert record["optimizer_state"] and record["optimizer_layout"] == "param_keyed", record
    assert record["optimizer_step"] == 8, record
    assert record["optimizer_tensors"]["exp_avg"] == record["optimizer_tensors"]["exp_avg_sq"] > 0
    assert record["plan"]["world_size"] == 4 and record["plan"]["layers"][0]["zero"] == 0
    assert record["bytes"] > 0 and record["files"] > 3

    damaged = root / "damaged"
    shutil.copytree(chain / "iter_0000008", damaged / "iter_0000008")
    (damaged / "latest_checkpointed_iteration.txt").write_text("8")
    (damaged / "iter_0000008" / "common.pt").write_bytes(b"x")
    broken = inspect_checkpoint(damaged)
    assert not broken["intact"] and "common.pt" in broken["damage"], broken

    result = subprocess.run([sys.executable, "-m", "megatron_ext.cli", "checkpoint", "inspect",
                             str(root)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"megatron-ext: error: checkpoint inspect: {root} has no latest_checkpointed_iteration"
        ".txt and is not an iter_NNNNNNN directory; pass the directory --save wrote"), result.stderr
