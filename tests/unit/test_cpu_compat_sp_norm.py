"""SP-capable norms and the local GPT spec helpers (no process group needed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.megatron_adapter.sp_norm import (
    SPLayerNorm,
    SPNorm,
    SPRMSNorm,
    gpt_block_spec,
    gpt_layer_spec,
)


def _config(sp: bool, **overrides: object) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        tensor_model_parallel_size=2 if sp else 1,
        sequence_parallel=sp,
        **overrides,
    )


@pytest.mark.parametrize("sp", [True, False])
def test_sp_norm_tags_params_like_apex_fused_layer_norm(sp: bool) -> None:
    norm = SPNorm(_config(sp), hidden_size=64, eps=1e-6, persist_layer_norm=False)
    assert isinstance(norm, SPLayerNorm) and norm.eps == 1e-6
    assert [p.sequence_parallel for p in norm.parameters()] == [sp, sp]
    x = torch.randn(8, 2, 64)  # [s/tp, b, h]
    torch.testing.assert_close(norm(x), torch.nn.functional.layer_norm(x, (64,), eps=1e-6))


def test_sp_norm_rms_and_rejections() -> None:
    rms = SPNorm(_config(True, normalization="RMSNorm"), hidden_size=64)
    assert isinstance(rms, SPRMSNorm) and rms.weight.sequence_parallel
    config = dataclasses.replace(_config(True), normalization="L2Norm")
    with pytest.raises(ValueError, match="L2Norm"):
        SPNorm(config, hidden_size=64)
    with pytest.raises(ValueError, match="zero_centered_gamma"):
        SPLayerNorm(_config(True, layernorm_zero_centered_gamma=True), hidden_size=64)


def test_local_specs_use_sp_norm_only_under_sequence_parallel() -> None:
    sp_layer = gpt_layer_spec(_config(True), use_transformer_engine=False)
    assert sp_layer.submodules.input_layernorm is SPNorm
    assert sp_layer.submodules.pre_mlp_layernorm is SPNorm
    sp_block = gpt_block_spec(_config(True), use_transformer_engine=False, pp_rank=0)
    assert sp_block.layer_norm is SPNorm and len(sp_block.layer_specs) == 2
    assert all(s.submodules.input_layernorm is SPNorm for s in sp_block.layer_specs)

    plain_layer = gpt_layer_spec(_config(False), use_transformer_engine=False)
    assert plain_layer.submodules.input_layernorm is WrappedTorchNorm
    plain_block = gpt_block_spec(_config(False), use_transformer_engine=False, pp_rank=0)
    assert plain_block.layer_norm is WrappedTorchNorm
