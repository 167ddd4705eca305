"""Vocabulary parallelism on 4 gloo ranks against the same model without it (fp32).

Model: megatron-core TransformerBlocks (local spec) with uneven layer counts per stage, and a
vocabulary that does not divide the 4 vocabulary-parallel ranks (so the last shard is padded).
Baseline: Megatron's own layout (`TpVocabStage`: embedding on the first stage, output layer and
`vocab_parallel_cross_entropy` on the last) under Megatron's 1F1B schedule. Vocabulary
parallelism: the same body modules (same weights), the vocabulary split over pp x tp, under
the schedule `schedule_for_plan` picks for a vocab_parallel plan of that layout. Compared: every
micro-batch's loss report, every body gradient, and the full embedding / output-layer gradients
(gathered; tied: the sum of both).
One spawn runs both layouts (pp=4; pp=2 x tp=2), each with 4 variants (untied/tied x 1/2
barriers; per-token loss averaging on for the tied runs, Megatron's per-micro-batch mean
otherwise), fewer micro-batches than p + barriers, and a forward-only (evaluation) pass.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_ext.runtime.testing import run_distributed

pytestmark = pytest.mark.dist

SEED, HIDDEN, HEADS, SEQ, MBS, NUM_MICROBATCHES = 1234, 32, 4, 8, 2, 7
# fp32. Vocabulary parallelism reorders fp32 reductions (shard-wise online softmax, partial
# input gradients summed over 4 ranks, instead of one softmax): ~1e-7 relative per op. Measured
# worst cases over all checks: losses 2e-7 relative, gradients 1e-6 of each tensor's max. The
# bounds leave ~10x headroom and still catch a 1e-4-per-token loss offset (~2e-5 relative); a
# wrong shard, mask or scale is O(1e-2) or more.
LOSS_RTOL = 2e-6
GRAD_TOL = 1e-5
"""Gradients: max |got - expected| <= GRAD_TOL * max |expected|, per tensor."""
LAYOUTS = {  # (tp, pp, vocab size, layers per stage)
    "pp4": (1, 4, 127, (1, 2, 1, 2)),
    "pp2_tp2": (2, 2, 130, (1, 3)),
}
VARIANTS = [(tied, barriers) for tied in (False, True) for barriers in (1, 2)]


def _setup(tp: int, pp: int, vocab: int, layers: tuple[int, ...]) -> dict[str, Any]:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.megatron_adapter.cpu import compat as cpu_compat
    from megatron_ext.megatron_adapter.vocab.baseline import build_stage_body
    from megatron_ext.runtime.vocab.comm import new_vocab_comm_groups, vocab_rank_lists

    cpu_compat.apply()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             distributed_timeout_minutes=1)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(
        num_layers=sum(layers), hidden_size=HIDDEN, num_attention_heads=HEADS,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, deallocate_pipeline_outputs=True)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    body = build_stage_body(config, layers[stage], is_last=stage == pp - 1)
    stage_ranks = [[r * tp + t for t in range(tp)] for r in range(pp)]  # dp = 1
    groups = new_vocab_comm_groups(vocab_rank_lists(stage_ranks, tp),
                                   last_stage_root=(pp - 1) * tp, first_stage_root=0)
    gen = torch.Generator().manual_seed(SEED)
    data = [{"tokens": torch.randint(0, vocab, (MBS, SEQ), generator=gen),
             "labels": torch.randint(0, vocab, (MBS, SEQ), generator=gen),
             "loss_mask": (torch.rand(MBS, SEQ, generator=gen) > 0.25).float()}
            for _ in range(NUM_MICROBATCHES)]
    weights = {name: torch.randn(vocab, HIDDEN, generator=gen) * 0.5 for name in ("emb", "out")}
    return {"config": config, "body": body, "groups": groups, "data": data, "stage": stage,
            "weights": weights, "tp": tp, "pp": pp, "vocab": vocab, "layers": layers,
            "num_microbatches": NUM_MICROBATCHES, "forward_only": False}


def _init_method(tensor: torch.Tensor) -> None:
    torch.nn.init.zeros_(tensor)  # overwritten with the shared weights below


def _run_baseline(env: dict[str, Any], tied: bool) -> dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    from megatron_ext.megatron_adapter.vocab.baseline import (
        TpVocabStage,
        tp_vocab_forward_step,
    )

    pp, stage, w = env["pp"], env["stage"], env["weights"]
    model = TpVocabStage(env["body"], vocab_size=env["vocab"], is_first=stage == 0,
                         is_last=stage == pp - 1, init_method=_init_method)
    tp_rank, tp = parallel_state.get_tensor_model_parallel_rank(), env["tp"]
    rows = env["vocab"] // tp
    shard = slice(tp_rank * rows, (tp_rank + 1) * rows)
    if model.embedding is not None:
        model.embedding.weight.data.copy_(w["emb"][shard])
    if model.output_layer is not None:
        model.output_layer.weight.data.copy_(w["emb" if tied else "out"][shard])
    losses = forward_backward_pipelining_without_interleaving(
        forward_step_func=tp_vocab_forward_step, data_iterator=iter(env["data"]), model=[model],
        num_microbatches=env["num_microbatches"], seq_length=SEQ, micro_batch_size=MBS,
        forward_only=env["forward_only"])
    full = {name: torch.zeros(env["vocab"], HIDDEN) for name in ("emb", "out")}
    if model.embedding is not None and model.embedding.weight.grad is not None:
        full["emb"][shard] = model.embedding.weight.grad
    if model.output_layer is not None and model.output_layer.weight.grad is not None:
        full["out"][shard] = model.output_layer.weight.grad
    for tensor in full.values():
        dist.all_reduce(tensor)  # every stage / tp rank contributes its own rows
    if tied:
        full = {"emb": full["emb"] + full["out"]}
    return {"losses": losses, "vocab_grads": full, "body_grads": _take_body_grads(env["body"])}


def _run_vocab_parallel(env: dict[str, Any], tied: bool, barriers: int) -> dict[str, Any]:
    from megatron_ext.megatron_adapter.vocab.baseline import block_forward_step
    from megatron_ext.megatron_adapter.vocab.layers import (
        VocabParallelLayers,
        VocabParallelStage,
    )
    from megatron_ext.megatron_adapter.vocab.schedule import schedule_for_plan

    groups, w = env["groups"], env["weights"]
    layers = VocabParallelLayers(config=env["config"], vocab_size=env["vocab"],
                                 hidden_size=HIDDEN, group=groups.vocab, tie_embeddings=tied,
                                 init_method=_init_method)
    part = layers.partition
    rows = slice(part.shard_start(groups.rank), part.shard_start(groups.rank) + part.shard_size)
    for name, param in (("emb", layers.input_weight), ("out", layers.output_weight)):
        padded = torch.cat([w[name], torch.randn(part.padded_vocab_size - part.vocab_size,
                                                 HIDDEN)])  # padding rows: arbitrary values
        if not (tied and name == "out"):
            param.data.copy_(padded[rows])
    model = VocabParallelStage(env["body"], layers)
    schedule = schedule_for_plan(_plan(env, barriers), groups)  # plan.vocab picks the schedule
    losses = schedule(forward_step_func=block_forward_step, data_iterator=iter(env["data"]),
                      model=[model], num_microbatches=env["num_microbatches"], seq_length=SEQ,
                      micro_batch_size=MBS, forward_only=env["forward_only"])
    names = ("emb",) if tied else ("emb", "out")
    full = {}
    for name, param in zip(names, (layers.input_weight, layers.output_weight)):
        grad = torch.zeros(part.padded_vocab_size, HIDDEN)
        if param.grad is not None:
            grad[rows] = param.grad
        dist.all_reduce(grad)
        full[name] = grad
    return {"losses": losses, "vocab_grads": full, "body_grads": _take_body_grads(env["body"])}


def _plan(env: dict[str, Any], barriers: int) -> Any:
    """The layout as a plan file would give it (plan algorithm = number of barriers)."""
    from megatron_ext.plan import LayerStrategy, ParallelPlan, VocabStrategy
    from megatron_ext.specs import ModelSpec

    tp, layers = env["tp"], env["layers"]
    bounds = [sum(layers[:k]) for k in range(len(layers) + 1)]
    model = ModelSpec(num_layers=sum(layers), hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN,
                      num_attention_heads=HEADS, num_query_groups=HEADS, vocab_size=env["vocab"],
                      activation="gelu", normalization="LayerNorm", max_position_embeddings=SEQ)
    return ParallelPlan(
        world_size=4, pp=env["pp"], stages=tuple(itertools.pairwise(bounds)),
        layers=(LayerStrategy(tp=tp, dp=1),) * sum(layers), model=model,
        micro_batch_size=MBS, global_batch_size=MBS * env["num_microbatches"], seq_length=SEQ,
        vocab=VocabStrategy(mode="vocab_parallel", tp=tp, algorithm=barriers), precision="fp32")


def _take_body_grads(body: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in body.named_parameters() if p.grad is not None}
    for p in body.parameters():
        p.grad = None
    return grads


def _compare(ref: dict[str, Any], got: dict[str, Any], vocab: int) -> float:
    """Asserts parity; returns the largest deviation seen, relative to each tensor's max."""
    assert len(ref["losses"]) == len(got["losses"])
    worst = 0.0
    for i, (r, g) in enumerate(zip(ref["losses"], got["losses"])):
        torch.testing.assert_close(g["lm loss"], r["lm loss"], rtol=LOSS_RTOL, atol=0.0,
                                   msg=f"loss of micro-batch {i}")
        worst = max(worst, float(((g["lm loss"] - r["lm loss"]) / r["lm loss"]).abs().max()))
    assert set(ref["body_grads"]) == set(got["body_grads"])
    pairs = [(n, ref["body_grads"][n], got["body_grads"][n]) for n in ref["body_grads"]]
    for name, grad in got["vocab_grads"].items():
        assert torch.count_nonzero(grad[vocab:]) == 0, f"{name}: padded rows got gradient"
        pairs.append((f"{name} weight", ref["vocab_grads"][name], grad[:vocab]))
    for name, expected, actual in pairs:
        scale = float(expected.abs().max())
        if scale == 0:  # forward only: no gradient on either side
            assert torch.count_nonzero(actual) == 0, f"{name}: unexpected gradient"
            continue
        deviation = float((actual - expected).abs().max()) / scale
        assert deviation <= GRAD_TOL, f"{name}: deviation {deviation:.1e}"
        worst = max(worst, deviation)
    return worst


def _layout_checks(layout: str, rank: int) -> dict[str, Any]:
    from megatron.core import parallel_state

    tp, pp, vocab, layers = LAYOUTS[layout]
    env = _setup(tp, pp, vocab, layers)
    out: dict[str, Any] = {}

    def check(key: str, ref: dict[str, Any], got: dict[str, Any]) -> None:
        try:
            out[key] = _compare(ref, got, vocab)
        except AssertionError as err:
            out[key] = f"rank {rank}: {err}"

    for tied in (False, True):
        env["config"].calculate_per_token_loss = tied
        ref = _run_baseline(env, tied)
        for barriers in (1, 2):
            check(f"tied={tied},barriers={barriers}", ref, _run_vocab_parallel(env, tied, barriers))
    env["config"].calculate_per_token_loss = False
    env["num_microbatches"] = 3  # fewer than p + barriers: warm-up is cut short
    check("few_microbatches", _run_baseline(env, False), _run_vocab_parallel(env, False, 2))
    env["num_microbatches"] = NUM_MICROBATCHES
    env["forward_only"] = True
    with torch.no_grad():
        check("forward_only", _run_baseline(env, True), _run_vocab_parallel(env, True, 1))
    parallel_state.destroy_model_parallel()
    return out


def _all_checks(rank: int, world_size: int) -> dict[str, Any]:
    """One spawn (megatron's import dominates the run time) for every layout."""
    return {f"{layout}:{key}": value for layout in LAYOUTS
            for key, value in _layout_checks(layout, rank).items()}


@functools.cache
def _outcomes() -> tuple[dict[str, Any], ...]:
    return tuple(run_distributed(_all_checks, world_size=4, timeout_s=600,
                                 collective_timeout_s=120))


CHECKS = [f"tied={t},barriers={b}" for t, b in VARIANTS] + ["few_microbatches", "forward_only"]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vocab_parallel_matches_megatron_layout(layout: str, check: str) -> None:
    key = f"{layout}:{check}"
    results = [per_rank[key] for per_rank in _outcomes()]
    failures = [r for r in results if isinstance(r, str)]
    assert not failures, "\n".join(failures)
    print(f"{key}: max deviation / max |value| = {max(results):.1e}")
