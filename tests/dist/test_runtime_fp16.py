"""fp16 on the layerwise runtime: megatron-core's dynamic loss scaler over the whole chain of
optimizers (one found-inf decision per step, every rank), against one process.

The reference is a single-process fp16 GPTModel trained the way megatron-core's
`Float16OptimizerWithFloat16Params` trains it: per-token loss sums scaled by the loss scale,
fp16 gradients accumulated over micro-batches and divided by the global token count (the
runtime's `finalize_grads`), copied to fp32 master grads, unscaled and checked for inf/NaN,
megatron-core's `DynamicGradScaler` updated, the step skipped on overflow, else clipped and
AdamW-stepped on the fp32 masters. The initial scale is chosen so the first steps overflow in
fp16 (the backward of the scaled loss exceeds 65504) and the scale comes down.

Checked: the sequence of skip/no-skip decisions and of loss scales equals the reference's
exactly, and the losses agree to rtol 2e-2 (fp16 with another summation order per TP/DP split:
~1e-3 per step, compounded over 7 AdamW steps at lr 3e-3). The run also injects an inf into one
gradient shard on one rank only (a ZeRO-2 layer's FSDP2 shard, held by no other rank) at the
fifth step: every rank skips that step, as the reference with the same injection does (and the
reference without it does not). One 4-rank run; the references run on rank 0 afterwards.

Why the plan's ZeRO-2/3 layers have dp=1 and there is one micro-batch: FSDP2 reduces and
accumulates their gradients in fp32 (the shards are fp32 master weights), so a sum over ranks
or micro-batches that overflows fp16 in one process (and in DDP's fp16 buffers) stays finite
there; with several partial sums the overflow thresholds of the two sides differ by up to the
number of partials, and a decision within that band is not a parity question.
"""

from __future__ import annotations

import warnings

import pytest

from megatron_ext.plan import LayerStrategy as L
from megatron_ext.plan import VocabStrategy as V
from megatron_ext.runtime.testing import run_distributed

pytestmark = pytest.mark.dist

STEPS = 7
INJECT_STEP = 4
SCALER = {"initial_loss_scale": 2.0 ** 12, "min_loss_scale": 1.0, "loss_scale_window": 2,
          "hysteresis": 2}


def _plan():
    import dataclasses

    from megatron_ext.presets import MODEL_PRESETS
    from tests.dist.runtime_parity import make_plan

    plan = make_plan(  # stage 0: 3 gradient classes, stage 1: 2 (one found-inf for all)
        MODEL_PRESETS["tiny-gpt"],
        [L(tp=2, zero=3), L(dp=2, zero=0), L(tp=2, zero=2), L(tp=2, sp=True, zero=1)],
        pp=2, stages=[(0, 2), (2, 4)], num_mb=1, vocab=V(tp=2))
    return dataclasses.replace(plan, precision="fp16")


def _opt_config(plan):
    import torch
    from megatron.core.optimizer import OptimizerConfig

    from tests.dist.runtime_parity import CLIP, LR, WEIGHT_DECAY

    return OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP,
                           fp16=True, bf16=False, params_dtype=torch.float16, **SCALER)


def _scaler():
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    return DynamicGradScaler(initial_scale=SCALER["initial_loss_scale"],
                             min_scale=SCALER["min_loss_scale"], growth_factor=2.0,
                             backoff_factor=0.5, growth_interval=SCALER["loss_scale_window"],
                             hysteresis=SCALER["hysteresis"])


def reference(plan, batches, seed: int, inject_step: int | None) -> list[tuple]:
    """(loss, skipped, loss scale after the step) per step, in one process."""
    import torch
    import torch.nn.functional as F

    from tests.dist.runtime_parity import CLIP, LR, WEIGHT_DECAY, reference_model

    model = reference_model(plan, seed, precision="fp16")
    named = dict(model.named_parameters())
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in named.items()}
    no_decay = [n for n, p in named.items() if n.endswith(".bias") or p.dim() == 1]
    opt = torch.optim.AdamW(
        [{"params": [masters[n] for n in named if n in no_decay], "weight_decay": 0.0},
         {"params": [masters[n] for n in named if n not in no_decay],
          "weight_decay": WEIGHT_DECAY}], lr=LR)
    scaler = _scaler()
    out = []
    for step, micro in enumerate(batches):
        model.zero_grad(set_to_none=True)
        tokens = sum(b["loss_mask"].sum() for b in micro)
        loss_sum = 0.0
        scale = scaler.scale.item()
        for b in micro:
            positions = torch.arange(plan.seq_length).expand_as(b["tokens"])
            logits = model(b["tokens"], positions, None).float()  # [b, s, v]
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["labels"].reshape(-1),
                                 reduction="none")
            loss = (ce * b["loss_mask"].reshape(-1)).sum()
            (loss * scale).backward()
            loss_sum += loss.item()
        grads = []
        for n, p in named.items():  # fp16 grads / tokens, then fp32 master grads
            masters[n].grad = (p.grad * (1.0 / tokens.item())).float()
            grads.append(masters[n].grad)
        if step == inject_step:
            grads[-1].view(-1)[0] = float("inf")
        found = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, scaler.inv_scale)
        skipped = bool(found.item() > 0)
        scaler.update(skipped)
        if not skipped:
            torch.nn.utils.clip_grad_norm_(list(masters.values()), CLIP)
            opt.step()
            with torch.no_grad():
                for n, p in named.items():
                    p.copy_(masters[n])
        out.append((loss_sum / tokens.item(), skipped, scaler.scale.item()))
    return out


def _run(rank: int, world_size: int) -> dict:
    warnings.filterwarnings("ignore")
    from torch.distributed.tensor import DTensor

    from tests.dist.runtime_parity import (
        _singleton_pgc,
        layerwise_backend,
        make_batches,
        rank_rows,
    )

    _singleton_pgc()  # collective, for the reference rank 0 builds at the end
    plan = _plan()
    batches = make_batches(plan, STEPS)
    backend = layerwise_backend(plan, seed=11, opt=_opt_config(plan))
    chunks, optimizer = backend.model, backend.optimizer
    got = []
    for step, micro in enumerate(batches):
        chunks[0].zero_grad_buffer()
        optimizer.zero_grad()
        loss = backend.forward_backward(rank_rows(backend, micro))  # train_step's
        if step == INJECT_STEP and rank == 3:  # a ZeRO-2 shard that only rank 3 holds
            grad = chunks[0].module.decoder.layers["2"].mlp.linear_fc1.weight.grad
            assert isinstance(grad, DTensor)
            grad.to_local().view(-1)[0] = float("inf")
        ok, _, _ = optimizer.step()
        got.append((loss, not ok, optimizer.get_loss_scale().item()))
    results = {"got": got}
    if rank == 0:  # one process: the references, once the other ranks are done
        results["ref"] = reference(plan, batches, seed=11, inject_step=INJECT_STEP)
        results["ref_plain"] = reference(plan, batches[:INJECT_STEP + 1], seed=11,
                                         inject_step=None)
    return results


def test_fp16_loss_scale_parity() -> None:
    """Skip decisions and loss scales equal one process's, with natural overflows and one
    injected on a single rank; losses close."""
    results = run_distributed(_run, world_size=4, timeout_s=900)
    ref = results[0]["ref"]
    for rank_results in results:
        got = rank_results["got"]
        assert [g[1:] for g in got] == [r[1:] for r in ref], (got, ref)
        for (loss, _, _), (ref_loss, _, _) in zip(got, ref):
            assert abs(loss - ref_loss) <= 2e-2 * ref_loss, (got, ref)
    skipped = [g[1] for g in results[0]["got"]]
    assert any(skipped[:INJECT_STEP]) and not all(skipped), skipped  # natural overflows
    assert skipped[INJECT_STEP], skipped  # the injected one, on every rank
    plain = [r[1] for r in results[0]["ref_plain"]]
    assert plain[:INJECT_STEP] == skipped[:INJECT_STEP] and not plain[INJECT_STEP], plain
