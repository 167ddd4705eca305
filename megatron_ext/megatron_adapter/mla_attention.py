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
(:391-403): it gets it here.

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
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = ["LayerGroupMLASelfAttention"]

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


class LayerGroupMLASelfAttention(MLASelfAttention):
    """MLASelfAttention whose latent gather/scatter use the layer's tensor-parallel group, and
    whose `linear_q_proj` (no query compression) is built on it: megatron-core builds that one
    projection without a group (multi_latent_attention.py:391-403), i.e. on the global one."""

    def __init__(self, config: Any, submodules: Any, *args: Any, pg_collection: Any = None,
                 **kwargs: Any) -> None:
        if config.q_lora_rank is None and pg_collection is not None:
            q_proj = ModuleSpec(module=submodules.linear_q_proj,
                                params={"tp_group": pg_collection.tp})
            submodules = dataclasses.replace(submodules, linear_q_proj=q_proj)
        if config.q_lora_rank is None and submodules.q_layernorm is not IdentityOp:
            # without a query latent there is no q norm: 0.16 does not build it
            # (multi_latent_attention.py:497), 0.19 rejects a non-identity one
            # (mla_qk_norm_config.py:259); the stock spec sets it from --qk-layernorm alone
            submodules = dataclasses.replace(submodules, q_layernorm=IdentityOp)
        super().__init__(config, submodules, *args, pg_collection=pg_collection, **kwargs)

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any) -> Any:
        with _bound_to(self.tp_group, self.config):
            return super().get_query_key_value_tensors(*args, **kwargs)
