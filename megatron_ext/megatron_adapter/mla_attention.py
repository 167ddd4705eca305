"""megatron-core's MLA self-attention with the layer's own tensor-parallel group everywhere.

megatron-core 0.16.1's `MLASelfAttention.get_query_key_value_tensors`
(transformer/multi_latent_attention.py:594-614) gathers the column-parallel latents with
`gather_from_tensor_model_parallel_region(x)` and scatters them back with
`scatter_to_sequence_parallel_region(x)` without a group, i.e. over parallel_state's global
tensor-parallel group, while every other collective of the layer uses `self.tp_group` (:622). The
layerwise runtime gives each layer its own groups and never initialises the global ones, so those
two calls get no group (AttributeError) or, where a global group exists, the wrong one. Only the
local spec reaches them (its down projections are column-parallel); the Transformer Engine spec
replicates the down projections and takes the other branch.

The same branch also loses gradient: after the gather every TP rank holds the full
`[.., kv_lora_rank + qk_pos_emb_head_dim]` latent and the shared RoPE key k_pos_emb (:607-612),
but uses k_pos_emb for its own heads only, and the gather's backward (a split) hands each rank
its own slice of a gradient whose RoPE-key part holds only that rank's heads; the compressed
part is complete (linear_kv_up_proj all-reduces its input gradient). So the RoPE-key gradient
must be summed over TP before the split, which megatron-core does not do (the TE spec's
sequence-parallel branch does it, :622, through gather_from_sequence_parallel_region's
reduce-scatter).

Without query compression megatron-core also builds `linear_q_proj` without the layer's group
(:391-403): it gets it here. There, with --qk-layernorm, 0.19 also normalises the query inside a
fused norm+linear `linear_q_proj` that only Transformer Engine provides
(mla_qk_norm_config.py:132-167); on the local spec it is `LocalLayerNormColumnParallelLinear`
(norm_linear.py), so the model is 0.19's on both specs (0.16 has no query norm there).

`LayerGroupMLASelfAttention` runs the same method with those two functions bound to the layer's
group (the module globals the method looks up, swapped for the call), and the key latent's
gather followed by `_SumRopeKeyGrad` (identity forward; backward all-reduces the RoPE-key
columns over the group); nothing else changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.megatron_adapter import compat
from megatron_ext.megatron_adapter.norm_linear import LocalLayerNormColumnParallelLinear

__all__ = ["LayerGroupMLASelfAttention", "layer_group_mla_block", "layer_group_mla_layer"]

_MODULE: Any = importlib.import_module("megatron.core.transformer.multi_latent_attention")
_GROUPLESS = ("gather_from_tensor_model_parallel_region", "scatter_to_sequence_parallel_region")


class _SumRopeKeyGrad(torch.autograd.Function):
    """Identity forward; backward sums the last `rope` columns of the gradient over `group`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rope: int, group: Any) -> torch.Tensor:
        ctx.rope, ctx.group = rope, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone()
        part = grad[..., -ctx.rope:].contiguous()  # [.., qk_pos_emb_head_dim]
        dist.all_reduce(part, group=ctx.group)
        grad[..., -ctx.rope:] = part
        return grad, None, None


@contextlib.contextmanager
def _bound_to(group: Any, config: Any) -> Iterator[None]:
    originals = {name: getattr(_MODULE, name) for name in _GROUPLESS}
    gather = originals["gather_from_tensor_model_parallel_region"]
    key_width = config.kv_lora_rank + config.qk_pos_emb_head_dim
    calls = iter(["q", "kv"] if config.q_lora_rank is not None else ["kv"])

    def gather_latent(x: torch.Tensor) -> torch.Tensor:
        full = gather(x, group=group)
        if next(calls) == "kv":  # the order get_query_key_value_tensors gathers them
            assert full.shape[-1] == key_width
            return _SumRopeKeyGrad.apply(full, config.qk_pos_emb_head_dim, group)
        return full

    try:
        _MODULE.gather_from_tensor_model_parallel_region = gather_latent
        _MODULE.scatter_to_sequence_parallel_region = functools.partial(
            originals["scatter_to_sequence_parallel_region"], group=group)
        yield
    finally:
        for name, fn in originals.items():
            setattr(_MODULE, name, fn)


def _without_query_latent(config: Any, submodules: Any, pg_collection: Any) -> Any:
    """The submodules of an MLA layer without q_lora_rank: no q norm (0.16 does not build it,
    multi_latent_attention.py:497; 0.19 rejects it, mla_qk_norm_config.py:259; the stock spec
    sets it from --qk-layernorm alone); where megatron-core normalises the query
    (compat.mla_normalises_query), the local spec's linear_q_proj becomes the local fused
    norm+linear; and linear_q_proj gets the layer's tensor-parallel group."""
    q_proj = submodules.linear_q_proj
    if config.qk_layernorm and compat.mla_normalises_query() and q_proj is ColumnParallelLinear:
        q_proj = LocalLayerNormColumnParallelLinear
    if pg_collection is not None:
        q_proj = ModuleSpec(module=q_proj, params={"tp_group": pg_collection.tp})
    return dataclasses.replace(submodules, linear_q_proj=q_proj, q_layernorm=IdentityOp)


class LayerGroupMLASelfAttention(MLASelfAttention):
    """MLASelfAttention whose latent gather/scatter use the layer's tensor-parallel group, and
    whose `linear_q_proj` (no query compression) is built on it: megatron-core builds that one
    projection without a group (multi_latent_attention.py:391-403), i.e. on the global one.
    On 0.19 its q/kv norm resolution knows the local fused norm+linear."""

    def __init__(self, config: Any, submodules: Any, *args: Any, pg_collection: Any = None,
                 **kwargs: Any) -> None:
        if config.q_lora_rank is None:
            submodules = _without_query_latent(config, submodules, pg_collection)
        super().__init__(config, submodules, *args, pg_collection=pg_collection, **kwargs)

    def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:
        # megatron-core 0.19+ only (0.16 has no resolver and never calls this)
        return compat.mla_qk_norm_classes(self.config, submodules,
                                          LocalLayerNormColumnParallelLinear)

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any) -> Any:
        with _bound_to(self.tp_group, self.config):
            return super().get_query_key_value_tensors(*args, **kwargs)


def layer_group_mla_layer(spec: ModuleSpec) -> ModuleSpec:
    """A local-spec GPT layer spec with MLA whose attention is `LayerGroupMLASelfAttention`."""
    attention = dataclasses.replace(spec.submodules.self_attention,
                                    module=LayerGroupMLASelfAttention)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                    self_attention=attention))


def layer_group_mla_block(block: Any) -> Any:
    """`layer_group_mla_layer` on every layer of a TransformerBlockSubmodules."""
    return dataclasses.replace(block, layer_specs=[layer_group_mla_layer(spec)
                                                   for spec in block.layer_specs])
