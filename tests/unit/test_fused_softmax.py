"""Megatron's fused scale-mask-softmax falls back to torch softmax on some shapes
(FusedScaleMaskSoftmax.is_kernel_available); the unfused-attention cost prices the fallback's
extra kernels and HBM passes. Shapes and expected values from compute.py's docstrings."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.plan import LayerStrategy
from megatron_ext.planner.cost import compute as C
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.space import StrategyTable
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.presets import cluster_preset, model_preset


def test_kernel_availability_follows_megatron_rule():
    gpt = model_preset("gpt3-1.3b")
    assert gpt.num_attention_heads == 16

    def ok(b, shards, s=2048, e=2):
        return bool(C.fused_softmax_available(gpt, b=b, seq_length=s, heads_shards=shards,
                                              element_bytes=e))

    assert ok(1, 4)           # 4 heads per rank: b * np = 4
    assert not ok(1, 8)       # 2 heads per rank: not a multiple of 4 batches per block
    assert ok(2, 8)           # two samples make it 4 again
    assert not ok(1, 16) and not ok(2, 16) and ok(4, 16)
    assert not ok(1, 1, e=4)  # fp32 input: never the fused kernel
    assert not ok(1, 1, s=8192) and ok(1, 1, s=4096)  # 16 < s <= 4096
    assert not ok(1, 1, s=2046)  # s % 4
    assert not ok(1, 1, s=16)
    assert not ok(1, 4, s=128) and ok(2, 4, s=128)  # s <= 128: 8 batches per block
    got = C.fused_softmax_available(gpt, b=np.array([1.0, 1.0, 2.0, 0.1]), seq_length=1024,
                                    heads_shards=np.array([4, 8, 8, 1]), element_bytes=2)
    assert got.tolist() == [True, False, True, False]  # not whole batches: no


def test_fallback_prices_extra_kernels_and_traffic():
    gpt = model_preset("gpt3-1.3b")
    base = C.layer_forward_kernels(gpt, flash_attention=False, dropout=True)
    torch_path = C.layer_forward_kernels(gpt, flash_attention=False, dropout=True,
                                         fused_softmax=False)
    assert torch_path == base + C.TORCH_SOFTMAX_EXTRA_KERNELS
    # flash attention has no softmax kernel of its own: the flag changes nothing
    assert C.layer_forward_kernels(gpt, flash_attention=True, dropout=True,
                                   fused_softmax=False) == base - 5
    f0, b0 = C.attention_score_bytes(gpt, 1, 2048, 8, flash=False)
    f1, b1 = C.attention_score_bytes(gpt, 1, 2048, 8, flash=False, fused_softmax=False)
    elements = 1 * 16 * 2048**2 / 8
    assert f1 - f0 == pytest.approx(C.TORCH_SOFTMAX_BYTES_FORWARD * elements)
    assert b1 - b0 == pytest.approx(C.TORCH_SOFTMAX_BYTES_BACKWARD * elements)
    assert C.attention_score_bytes(gpt, 1, 2048, 8, flash=True, fused_softmax=False) == (0, 0)


def test_layer_costs_slow_down_only_where_the_kernel_falls_back():
    """TP 8 of a 16-head model at one sample (2 heads per rank) falls back; two samples and
    TP 4 keep the fused kernel (fp16 training)."""
    gpt = model_preset("gpt3-1.3b")
    cluster = cluster_preset("dgx-a100-80g", num_nodes=2)
    table = StrategyTable.of([LayerStrategy(tp=t, dp=1, zero=0, recompute="full")
                              for t in (4, 8)])

    def per_sample(mbs: int, flash: bool) -> np.ndarray:
        cm = CostModel(gpt, cluster, TrainingSpec(global_batch_size=64, seq_length=2048,
                                                  precision="fp16", flash_attention=flash))
        lc = cm.layer_costs(table, mbs)
        assert cm.fused_softmax(table, mbs).tolist() == [True, mbs >= 2]
        return (lc.forward_s + lc.backward_s) / mbs

    one, two = per_sample(1, False), per_sample(2, False)
    # a second sample costs less than twice one where the fallback is paid only at one sample
    assert one[1] / two[1] > 1.0 + 0.5 * (one[0] / two[0] - 1.0)
    # the fallback alone: the same layers priced as if the kernel took every shape
    cm = CostModel(gpt, cluster, TrainingSpec(global_batch_size=64, seq_length=2048,
                                              precision="fp16", flash_attention=False))
    cm.fused_softmax = lambda table, b: np.ones(len(table.tp), dtype=bool)
    fused = cm.layer_costs(table, 1)
    slower = (one * 1 - (fused.forward_s + fused.backward_s))
    assert slower[0] == 0.0 and slower[1] > 0.0
