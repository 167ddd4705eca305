"""Which checkpoints can restore their optimizer state under another plan (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.ddp import chain_kinds
from megatron_ext.megatron_adapter.training.checkpoint import (
    check_optimizer_layout,
    gradient_class_counts,
)
from megatron_ext.plan import LayerStrategy, ParallelPlan, VocabStrategy
from megatron_ext.presets import model_preset

TP2 = LayerStrategy(tp=2, sp=True, dp=1)
DP2 = LayerStrategy(tp=1, dp=2)
DP2_Z1 = LayerStrategy(tp=1, dp=2, zero=1)


def _plan(layers: tuple[LayerStrategy, ...], stages: tuple[tuple[int, int], ...],
          vocab: VocabStrategy) -> ParallelPlan:
    model = model_preset("tiny-llama")
    assert model.num_layers == len(layers) == stages[-1][1]
    return ParallelPlan(world_size=4, pp=len(stages), stages=stages, layers=layers, model=model,
                        micro_batch_size=2, global_batch_size=8, seq_length=64, vocab=vocab)


def test_counts_follow_the_runtime_gradient_classes() -> None:
    tp1 = VocabStrategy(mode="tp", tp=1)
    uniform = _plan((DP2,) * 4, ((0, 2), (2, 4)), tp1)
    assert gradient_class_counts(uniform) == (1, 1)
    mixed = _plan((TP2, TP2, DP2, DP2_Z1), ((0, 2), (2, 4)), tp1)
    # stage 0: tp2 layers + the tp1 embedding; stage 1: zero0 and zero1 layers, norm + output
    # with the last layer's zero level
    assert gradient_class_counts(mixed) == (2, 2)
    vp = _plan((TP2, TP2, DP2, DP2), ((0, 2), (2, 4)), VocabStrategy(mode="vocab_parallel", tp=1))
    assert gradient_class_counts(vp) == (2, 1)  # vocabulary shards on every stage


def test_a_different_chain_is_one_line_naming_the_fix() -> None:
    tp1 = VocabStrategy(mode="tp", tp=1)
    saved = _plan((DP2,) * 4, ((0, 2), (2, 4)), tp1)
    info = {"model_format": "layerwise", "plan": saved.to_json()}
    check_optimizer_layout(info, saved, "ckpt")  # same chain: loads
    other = _plan((TP2, TP2, DP2, DP2), ((0, 2), (2, 4)), tp1)
    with pytest.raises(PlanError, match=r"\[1, 1\] gradient classes .* \[2, 1\].*--no-load-optim"):
        check_optimizer_layout(info, other, "ckpt")
    # one optimizer per rank on both sides (stock, FlexSP, or one gradient class per stage):
    # megatron-core reshards it whatever the stages
    stock_pp1 = dataclasses.replace(saved, pp=1, stages=((0, 4),),
                                    layers=(LayerStrategy(tp=1, dp=4),) * 4, micro_batch_size=4)
    stock_info = {"model_format": "megatron", "plan": stock_pp1.to_json()}
    check_optimizer_layout(stock_info, saved, "ckpt")  # -> layerwise [1, 1]
    check_optimizer_layout(info, stock_pp1, "ckpt")  # layerwise [1, 1] -> stock
    with pytest.raises(PlanError, match=r"\[1\] gradient classes .* \[2, 1\]"):
        check_optimizer_layout(stock_info, other, "ckpt")


def test_stages_chaining_different_kinds_reload_only_into_the_same_chains() -> None:
    """ZeRO-1 (distributed), ZeRO-2/3 under bf16/fp16 (sharded) and the rest (local) have
    differently shaped states; a plan whose stages chain different kinds saves them per stage."""
    tp1 = VocabStrategy(mode="tp", tp=1)
    z2, z3 = dataclasses.replace(DP2, zero=2), dataclasses.replace(DP2, zero=3)
    saved = dataclasses.replace(_plan((z2, DP2_Z1, z3, DP2_Z1), ((0, 2), (2, 4)), tp1),
                                precision="fp16")
    assert chain_kinds(saved) == (("distributed", "sharded"), ("sharded", "distributed"))
    assert chain_kinds(dataclasses.replace(saved, precision="fp32")) == (
        ("distributed", "local"), ("local", "distributed"))
    info = {"model_format": "layerwise", "plan": saved.to_json(),
            "optimizer_chain": [list(k) for k in chain_kinds(saved)]}
    check_optimizer_layout(info, saved, "ckpt")
    swapped = dataclasses.replace(saved, layers=(z3, DP2_Z1, z2, DP2_Z1))  # same kinds: loads
    check_optimizer_layout(info, swapped, "ckpt")
    other = dataclasses.replace(saved, layers=(DP2, z2, z3, DP2_Z1))  # stage 0: local first
    with pytest.raises(PlanError, match=r"optimizers per pipeline stage .*--no-load-optim"):
        check_optimizer_layout(info, other, "ckpt")
