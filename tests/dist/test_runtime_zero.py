"""Per-layer ZeRO-2/3 (FSDP2 over each layer's dp_cp group) against a single-process
megatron-core GPTModel, mixed with DDP (zero=0) and distributed-optimizer (zero=1) layers in one
model and one optimizer step.

Same harness and tolerances as test_runtime_parity.py (fp32; losses of 5 AdamW steps with clip
and weight decay, every local gradient shard after step 1): losses rtol 1e-5, gradients rtol 1e-4
/ atol 1e-6. FSDP2 sums the same per-rank terms as DDP's all-reduce, in a different order
(~1e-7 relative); a missing or doubled reduction, a wrong shard or a stale gathered weight is a
factor of dp or an O(1) loss difference. The ZeRO-2/3 gradients are compared after reassembling
the reduce-scattered shards (`DTensor.full_tensor`).

All 4-rank plans share one spawn, all 8-rank plans another; the reference runs once per shape.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings

import pytest

from megatron_ext.plan import LayerStrategy as L
from megatron_ext.plan import VocabStrategy as V
from megatron_ext.runtime.testing import run_distributed

pytestmark = pytest.mark.dist

TOLERANCES = {"loss_rtol": 1e-5, "grad_rtol": 1e-4, "grad_atol": 1e-6}


def plans_4() -> dict:
    from megatron_ext.presets import MODEL_PRESETS
    from tests.dist.runtime_parity import make_plan

    llama, gpt = MODEL_PRESETS["tiny-llama"], MODEL_PRESETS["tiny-gpt"]  # GQA 2 / MHA, tied
    return {
        "zero-3 everywhere, tp1 dp4 and tp2 dp2": make_plan(
            llama, [L(dp=4, zero=3)] * 2 + [L(tp=2, dp=2, zero=3)] * 2),
        "zero-2 everywhere, tp2+sp dp2": make_plan(
            llama, [L(tp=2, sp=True, dp=2, zero=2)] * 4, vocab=V(tp=2)),
        "zero 2/0/3/1 mixed": make_plan(llama, [
            L(tp=2, dp=2, zero=2), L(dp=4), L(dp=4, zero=3), L(tp=2, sp=True, dp=2, zero=1)]),
        "zero-3 with full and selective recompute, cp2, ulysses2": make_plan(llama, [
            L(dp=4, zero=3, recompute="full"), L(cp=2, dp=2, zero=3),
            L(ulysses=2, dp=2, zero=2, recompute="selective"), L(tp=2, dp=2, zero=3,
                                                                   recompute="full")]),
        "pp2 zero 3|2 (MHA, tied), overlapped DDP beside": make_plan(
            gpt, [L(tp=2, zero=3), L(dp=2, zero=0), L(dp=2, zero=2), L(tp=2, sp=True, zero=1)],
            pp=2, stages=[(0, 2), (2, 4)], num_mb=4, vocab=V(tp=2)),
    }


def plans_8() -> dict:
    from megatron_ext.presets import MODEL_PRESETS
    from tests.dist.runtime_parity import make_plan

    gpt = MODEL_PRESETS["tiny-gpt"]
    return {
        "8 ranks: zero 3/2/1/0 on tp2 cp2 dp2, tp4+sp dp2, dp8, tp2 dp4": make_plan(
            gpt, [L(tp=2, cp=2, dp=2, zero=3), L(tp=4, sp=True, dp=2, zero=2), L(dp=8, zero=1),
                  L(tp=2, dp=4)], world=8, mbs=8, vocab=V(tp=2)),
        "8 ranks: pp2, zero-3 tp2 dp2 | zero-2 dp4": make_plan(
            gpt, [L(tp=2, dp=2, zero=3), L(tp=2, dp=2, zero=3), L(dp=4, zero=2),
                  L(dp=4, zero=3)], world=8, pp=2, stages=[(0, 2), (2, 4)], num_mb=4),
    }


def _check_checkpoint_reshard(plan_a, plan_b, path: str) -> tuple[float, float]:
    """Train `plan_a` 2 steps, save its model with megatron-core dist checkpointing, load it
    under `plan_b` (other layouts and ZeRO levels): the forward loss on a batch is the same."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_ext.megatron_adapter.training.loop import train_step
    from tests.dist.runtime_parity import layerwise_backend, make_batches, rank_rows

    micro = make_batches(plan_a, 1, seed=3)[0]
    backend = layerwise_backend(plan_a, seed=11)
    chunks = backend.model
    for _ in range(2):
        train_step(backend, rank_rows(backend, micro))
    before = backend.forward_backward(rank_rows(backend, micro), forward_only=True)
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    dist_checkpointing.save(chunks[0].sharded_state_dict(), path)
    backend_b = layerwise_backend(plan_b, seed=5)  # other initial weights
    chunks_b = backend_b.model
    loaded = dist_checkpointing.load(chunks_b[0].sharded_state_dict(), path)
    chunks_b[0].module.load_state_dict(loaded, strict=True)
    after = backend_b.forward_backward(rank_rows(backend_b, micro), forward_only=True)
    return before, after


def _layerwise_backend(plan, seed: int):
    """The layerwise backend of `plan` as the training loop holds it, with a constant-lr
    scheduler: what checkpoint.save_checkpoint / load_checkpoint take."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from tests.dist.runtime_parity import LR, WEIGHT_DECAY, layerwise_backend

    backend = layerwise_backend(plan, seed=seed)
    scheduler = OptimizerParamScheduler(
        backend.optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0,
        lr_decay_steps=100, lr_decay_style="constant", start_wd=WEIGHT_DECAY,
        end_wd=WEIGHT_DECAY, wd_incr_steps=100, wd_incr_style="constant")
    return backend, scheduler


def _check_optimizer_resume(plan_a, plan_b, path: str) -> dict:
    """ZeRO-2/3 optimizer states through checkpoint.py: `plan_a` trains 2 steps, saves
    (weights, moments, step, scheduler), trains 2 more; the checkpoint loaded into a freshly
    built `plan_a` (other initial weights) gives those 2 losses bit for bit, and loaded into
    `plan_b` (the ZeRO-3/2 layers resharded to other tp/dp degrees and levels) the same
    losses to fp32 rounding."""
    from megatron_ext.megatron_adapter.training.checkpoint import (
        TrainState,
        check_optimizer_layout,
        checkpoint_info,
        load_checkpoint,
        save_checkpoint,
    )
    from megatron_ext.megatron_adapter.training.checkpoint_files import resolve_load
    from megatron_ext.megatron_adapter.training.loop import train_step
    from tests.dist.runtime_parity import make_batches, rank_rows

    micro = make_batches(plan_a, 1, seed=3)[0]
    backend, scheduler = _layerwise_backend(plan_a, seed=11)
    for _ in range(2):
        train_step(backend, rank_rows(backend, micro))
    save_checkpoint(path, backend, scheduler, TrainState(iteration=2), plan_a)
    expected = [train_step(backend, rank_rows(backend, micro)).loss for _ in range(2)]
    resumed = []
    for plan in (plan_a, plan_b) if plan_b is not None else (plan_a,):
        check_optimizer_layout(checkpoint_info(path), plan, path)
        backend, scheduler = _layerwise_backend(plan, seed=5)
        state = load_checkpoint(resolve_load(path), backend, scheduler, plan)
        assert state.iteration == 2, state
        resumed.append([train_step(backend, rank_rows(backend, micro)).loss
                        for _ in range(2)])
    return {"expected": expected, "same_plan": resumed[0], "other_plan": resumed[-1]}


def _run_plans(rank: int, world_size: int, ckpt_dir: str | None = None) -> dict:
    warnings.filterwarnings("ignore")
    from tests.dist.runtime_parity import (
        check_sharded_state_dict,
        make_batches,
        reference_run,
        run_plan,
    )

    plans = plans_8() if world_size == 8 else plans_4()
    refs: dict = {}
    out = {}
    for name, plan in plans.items():
        start = time.perf_counter()
        key = (plan.model, plan.micro_batch_size, plan.num_microbatches, plan.seq_length)
        if key not in refs:
            refs[key] = reference_run(plan, make_batches(plan, 5), seed=11)
        result = run_plan(plan, ref=refs[key], seed=11, overlap="overlap" in name,
                          **TOLERANCES)
        out[name] = {**result, "seconds": time.perf_counter() - start}
    if ckpt_dir is not None:  # checkpoints: global keys, and resharding both ways
        mixed = plans["zero 2/0/3/1 mixed"]
        check_sharded_state_dict(mixed)
        other = dataclasses.replace(mixed, layers=(L(dp=4, zero=3), L(tp=2, dp=2, zero=2),
                                                   L(tp=2, dp=2), L(dp=4, zero=1)))
        before, after = _check_checkpoint_reshard(mixed, other, f"{ckpt_dir}/a")
        back, again = _check_checkpoint_reshard(other, mixed, f"{ckpt_dir}/b")
        out["checkpoint"] = {"losses": [before, after, back, again]}
        zero3 = plans["zero-3 everywhere, tp1 dp4 and tp2 dp2"]
        out["optimizer_checkpoint"] = _check_optimizer_resume(
            zero3, dataclasses.replace(zero3, layers=(L(tp=2, dp=2, zero=2),) * 2 + (
                L(dp=4, zero=3),) * 2), f"{ckpt_dir}/c")
        # stages chaining different kinds (stage 0: ZeRO-1 vocab, ZeRO-3, DDP; stage 1: ZeRO-2,
        # ZeRO-1): the chain is saved per stage
        out["optimizer_checkpoint_pp"] = _check_optimizer_resume(
            plans["pp2 zero 3|2 (MHA, tied), overlapped DDP beside"], None, f"{ckpt_dir}/d")
    return out


def _check(results: list[dict]) -> None:
    resume_pp = results[0].pop("optimizer_checkpoint_pp", None)
    if resume_pp is not None:
        assert resume_pp["same_plan"] == resume_pp["expected"], resume_pp
    resume = results[0].pop("optimizer_checkpoint", None)
    if resume is not None:  # same plan: bit for bit; resharded: fp32 summation order only
        assert resume["same_plan"] == resume["expected"], resume
        for got, want in zip(resume["other_plan"], resume["expected"]):
            assert abs(got - want) <= 1e-5 * want, resume
    checkpoint = results[0].pop("checkpoint", None)
    if checkpoint is not None:  # same weights, summed in other orders: fp32 rounding only
        before, after, back, again = checkpoint["losses"]
        assert abs(after - before) <= 1e-5 * before and abs(again - back) <= 1e-5 * back, \
            checkpoint
    for name, result in results[0].items():
        assert result["grads_compared"] > 0, name
        assert result["losses"][-1] < result["losses"][0] - 0.3, (name, result["losses"])


def test_zero_parity_4_ranks(tmp_path) -> None:
    """ZeRO-3 / ZeRO-2 alone, mixed 0/1/2/3, with recompute, CP, Ulysses, SP, PP and tying;
    checkpoint keys of a mixed plan, a model checkpoint resharded between ZeRO levels, and
    ZeRO-2/3 optimizer states resumed bit for bit and resharded to another plan."""
    _check(run_distributed(_run_plans, world_size=4, timeout_s=900, ckpt_dir=str(tmp_path)))


def test_zero_parity_8_ranks() -> None:
    """Mixed ZeRO levels over dp 2/4/8 groups with TP/CP/SP, and a 2-stage pipeline."""
    _check(run_distributed(_run_plans, world_size=8, timeout_s=900))
