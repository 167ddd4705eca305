"""The ModelSpec fields a HuggingFace config or Megatron-LM flags set beyond the shape (RoPE base
and Llama 3 scaling, q/k/v biases, q/k norms, norm epsilon) reach the megatron-core modules on
both training paths: the layerwise runtime (build_model) and the stock GPTModel (one rank each).

The RoPE check compares inv_freq with megatron-core's RotaryEmbedding built from the same numbers
and with the default (base 10000, no scaling): equal to the first, different from the second,
exactly (the same float computation, no tolerance needed).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ext.plan import LayerStrategy, ParallelPlan
from megatron_ext.presets import MODEL_PRESETS
from megatron_ext.runtime.testing import run_distributed

pytestmark = pytest.mark.dist

MODEL = dataclasses.replace(
    MODEL_PRESETS["tiny-llama"], rotary_base=500000, rope_scaling=True,
    rope_scaling_factor=32.0, add_qkv_bias=True, qk_layernorm=True, norm_epsilon=1e-6)


def _plan() -> ParallelPlan:
    return ParallelPlan(world_size=1, pp=1, stages=((0, MODEL.num_layers),),
                        layers=(LayerStrategy(),) * MODEL.num_layers, model=MODEL,
                        micro_batch_size=1, global_batch_size=1, seq_length=32,
                        precision="fp32")


def _expected_inv_freq(**kwargs) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(kv_channels=MODEL.head_dim, rotary_percent=1.0,
                           use_cpu_initialization=True, **kwargs).inv_freq


def _check(gpt: torch.nn.Module) -> dict[str, bool]:
    layer = gpt.decoder.layers[0]
    attention = layer.self_attention
    expected = _expected_inv_freq(rotary_base=500000, rope_scaling=True, rope_scaling_factor=32.0)
    default = _expected_inv_freq()
    inv_freq = gpt.rotary_pos_emb.inv_freq
    return {
        "rope": torch.equal(inv_freq, expected) and not torch.equal(inv_freq, default),
        "qkv_bias": attention.linear_qkv.bias is not None,
        "qk_norm": attention.q_layernorm is not None and attention.k_layernorm is not None,
        "eps": gpt.config.layernorm_epsilon == 1e-6,
    }


def _layerwise(rank: int, world_size: int) -> dict[str, bool]:
    from megatron_ext.megatron_adapter.build import build_model

    models, _ = build_model(_plan(), wrap_ddp=False)
    return _check(models[0])


def _stock(rank: int, world_size: int) -> dict[str, bool]:
    from megatron.core import parallel_state

    from megatron_ext.megatron_adapter.cpu import compat
    from megatron_ext.megatron_adapter.training.stock_backend import _build_gpt
    from megatron_ext.megatron_adapter.transformer_config import ModelOptions, transformer_config

    compat.apply(force=True)  # as pretrain_gpt.py --cpu does
    parallel_state.initialize_model_parallel()
    plan = _plan()
    config = transformer_config(plan.model, precision=plan.precision)
    return _check(_build_gpt(plan, ModelOptions(), config, 512, init="plan_invariant", seed=1,
                             layer_offset=0))


@pytest.mark.parametrize("path", [_layerwise, _stock], ids=["layerwise", "stock"])
def test_model_fields_reach_megatron_modules(path) -> None:
    (result,) = run_distributed(path, world_size=1)
    assert result == {"rope": True, "qkv_bias": True, "qk_norm": True, "eps": True}
