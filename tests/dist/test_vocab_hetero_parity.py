"""Vocabulary parallelism on the heterogeneous runtime against a single-process GPTModel (fp32).

Each plan runs `build_model` + the backend's `forward_backward` + the runtime's chained AdamW (what
`train_step` does, with the gradient check before the update) for
3 steps on one fixed global batch (runtime_parity.py), with vocab.mode = vocab_parallel: every
stage a body (different strategies per layer, uneven stages) holding its vocabulary shards.
Compared with the single-process reference (same plan-invariant weights, same data): the loss of
every step and every local gradient shard after step 1 (embedding and output-layer shards
against the matching rows of the reference's full gradients, every layer, the final norm).
Plans cover both algorithms (1 and 2 barriers), tied and untied embeddings, vocabulary sizes
that do not divide the vocabulary-parallel ranks (padded shard), vocab.tp 1 and 2, rope and
learned absolute position embeddings (held by the first stage's vocabulary module).

Tolerances (fp32), as in test_runtime_parity.py: losses rtol 1e-5, gradients rtol 1e-4 / atol
1e-6. Vocabulary parallelism reorders fp32 sums (shard-wise online softmax, input gradients
summed over ranks, replica reductions): ~1e-7 relative per op, which Adam can amplify on
near-zero gradient entries over the steps. A wrong shard, mask or scale is >= 1e-3.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch

from megatron_ext.runtime.testing import run_distributed

pytestmark = pytest.mark.dist

SEED, STEPS = 11, 3
# Plan names: stages separated by |, bN = N communication barriers (plan vocab.algorithm),
# vN = vocabulary size, vtp = vocab.tp, z1 = ZeRO-1, pos = learned absolute positions.
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-4, 1e-6


def _plans() -> dict[str, Any]:
    from megatron_ext.plan import LayerStrategy as L
    from megatron_ext.plan import VocabStrategy as V
    from megatron_ext.presets import MODEL_PRESETS
    from tests.dist.runtime_parity import make_plan

    llama = MODEL_PRESETS["tiny-llama"]
    gpt = dataclasses.replace(MODEL_PRESETS["tiny-gpt"], num_layers=6, vocab_size=130,
                              max_position_embeddings=16)  # tied, learned absolute positions
    return {
        "pp2 3|1 tp2+sp|dp2 pos b1 v127": make_plan(
            dataclasses.replace(llama, vocab_size=127, position_embedding="learned_absolute"),
            [L(tp=2, sp=True)] * 3 + [L(dp=2)],
            pp=2, stages=[(0, 3), (3, 4)], num_mb=4,
            vocab=V(mode="vocab_parallel", tp=1, algorithm=1)),
        "pp4 1|2|1|2 tied pos b2 v130": make_plan(
            gpt, [L()] * 6, pp=4, stages=[(0, 1), (1, 3), (3, 4), (4, 6)], mbs=2, num_mb=5,
            seq=16, vocab=V(mode="vocab_parallel", tp=1, algorithm=2)),
        "pp2 vtp2 dp2,tp2+sp|tp2,dp2z1 b2 v126": make_plan(
            dataclasses.replace(llama, vocab_size=126),
            [L(dp=2), L(tp=2, sp=True), L(tp=2), L(dp=2, zero=1)], pp=2,
            stages=[(0, 2), (2, 4)], num_mb=3, vocab=V(mode="vocab_parallel", tp=2, algorithm=2)),
    }


def _compare_grads(chunks: list, optimizer: Any, ref_grads: dict[str, torch.Tensor]) -> int:
    """Every local grad shard (vocabulary shards included) against the reference's."""
    from megatron_ext.megatron_adapter.weights import (
        _is_gated,
        local_shard,
        param_shards,
    )
    from tests.dist.runtime_parity import _owned_range

    model = chunks[0].module
    part = model.vocab.partition
    start = part.shard_start(model.vocab_groups.rank)
    vocab_keys = {"vocab.embedding.weight": "embedding.word_embeddings.weight",
                  "vocab.output_layer.weight": "output_layer.weight"}
    count = 0
    for name, param, tp in param_shards(model):
        if name == "vocab.position_embeddings.weight":  # first stage, replicated
            expected = ref_grads["embedding.position_embeddings.weight"]
        elif name in vocab_keys:
            full = torch.zeros(part.padded_vocab_size, param.shape[1])  # padding rows: 0
            full[:part.vocab_size] = ref_grads[vocab_keys[name]]
            expected = full[start:start + part.shard_size]
        else:
            expected = local_shard(name, ref_grads[name], param, tp, _is_gated(name, model))
        got = param.main_grad
        owned = _owned_range(chunks, optimizer, param)
        if owned is not None:
            got = got.reshape(-1)[owned[0]:owned[1]]
            expected = expected.reshape(-1)[owned[0]:owned[1]]
        torch.testing.assert_close(got, expected, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
        count += 1
    return count


def _run_plan(plan: Any) -> dict[str, Any]:
    from tests.dist.runtime_parity import (
        layerwise_backend,
        make_batches,
        rank_rows,
        reference_run,
    )

    batches = make_batches(plan, STEPS)
    ref_losses, ref_grads = reference_run(plan, batches, SEED, divisible_by=1)
    backend = layerwise_backend(plan, seed=SEED, make_vocab_size_divisible_by=1)
    assert backend.name == ("vocab_parallel" if plan.vocab.mode == "vocab_parallel"
                            else "layerwise")
    chunks, optimizer = backend.model, backend.optimizer
    losses, compared = [], 0
    for step, micro in enumerate(batches):
        chunks[0].zero_grad_buffer()
        optimizer.zero_grad()
        losses.append(backend.forward_backward(rank_rows(backend, micro)))  # train_step's
        if step == 0:  # before optimizer.step: clipping scales the grad buffers in place
            compared = _compare_grads(chunks, optimizer, ref_grads)
        optimizer.step()
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=LOSS_RTOL,
                               atol=0.0)
    return {"losses": losses, "grads_compared": compared}


def _all_plans(rank: int, world_size: int) -> dict[str, Any]:
    """One spawn for every plan (megatron's import and the spawn dominate the run time)."""
    out: dict[str, Any] = {}
    for name, plan in _plans().items():
        try:
            out[name] = _run_plan(plan)
        except AssertionError as err:
            out[name] = f"rank {rank}: {err}"
    return out


@functools.cache
def _outcomes() -> tuple[dict[str, Any], ...]:
    return tuple(run_distributed(_all_plans, world_size=4, timeout_s=600,
                                 collective_timeout_s=120))


@pytest.mark.parametrize("name", ["pp2 3|1 tp2+sp|dp2 pos b1 v127",
                                  "pp4 1|2|1|2 tied pos b2 v130",
                                  "pp2 vtp2 dp2,tp2+sp|tp2,dp2z1 b2 v126"])
def test_vocab_parallel_heterogeneous_plan_matches_single_process(name: str) -> None:
    results = [per_rank[name] for per_rank in _outcomes()]
    failures = [r for r in results if isinstance(r, str)]
    assert not failures, "\n".join(failures)
    assert all(r["grads_compared"] > 0 for r in results)
    print(f"{name}: losses {results[0]['losses']}")
