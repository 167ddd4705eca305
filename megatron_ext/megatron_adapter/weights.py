"""Full (unsharded) tensors <-> this rank's shards of a `HeteroGPTModel`, and plan-invariant init.

A parameter's global tensor is what a single-process (TP=1) megatron-core model holds under the
same name (`decoder.layers.{layer_idx}.*` with global indices). Tensor-parallel params carry
megatron's `tensor_model_parallel` / `partition_dim` attributes and their module's `tp_group`;
the gated (SwiGLU) fc1 is split per half, as in megatron's `apply_swiglu_sharded_factory`.
Routed experts of MoE layers are named by their global expert index
(`mlp.experts.local_experts.{e}`, as a single-process model holds them), and sharded over their
expert tp group.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig

__all__ = ["full_shape", "init_plan_invariant", "load_full_state_dict", "local_shard",
           "param_shards"]

_GATED_FC1 = ("linear_fc1.weight", "linear_fc1.bias")
_LOCAL_EXPERTS = ".experts.local_experts."
_LAYERS = "decoder.layers."


def _expert_offsets(model: torch.nn.Module) -> dict[str, list[int]]:
    """MoE layer module name -> global index of each of its local experts."""
    return {name: list(module.local_expert_indices) for name, module in model.named_modules()
            if hasattr(module, "local_expert_indices")}


def _global_module_name(module_name: str, offsets: dict[str, list[int]]) -> str:
    """`...mlp.experts.local_experts.{j}...` -> the same with j's global expert index."""
    head, sep, tail = module_name.partition(_LOCAL_EXPERTS)
    if not sep or head not in offsets:
        return module_name
    local, _, rest = tail.partition(".")
    return f"{head}{sep}{offsets[head][int(local)]}" + (f".{rest}" if rest else "")


def param_shards(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter,
                                                              dist.ProcessGroup | None]]:
    """(global name, param, its tp group or None when not tensor-parallel), each param once."""
    seen: set[int] = set()
    offsets = _expert_offsets(model)
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            tp = getattr(module, "tp_group", None)
            split = getattr(param, "tensor_model_parallel", False) and tp is not None
            name = _global_module_name(module_name, offsets)
            yield f"{name}.{pname}" if name else pname, param, tp if split else None


def _is_gated(name: str, model: torch.nn.Module) -> bool:
    """The fc1 of a gated MLP: dense, routed expert or shared expert ([gate; up] halves)."""
    return (name.endswith(_GATED_FC1) and (".mlp." in name or name.startswith("mlp."))
            and bool(getattr(model.config, "gated_linear_unit", False)))


def local_shard(name: str, full: torch.Tensor, param: torch.nn.Parameter,
                tp: dist.ProcessGroup | None, gated: bool) -> torch.Tensor:
    """This rank's part of the global tensor `full`."""
    if tp is None or dist.get_world_size(tp) == 1:
        return full
    dim, size, rank = param.partition_dim, dist.get_world_size(tp), dist.get_rank(tp)
    if gated:  # [gate; up] -> [gate_shard; up_shard]
        return torch.cat([half.chunk(size, dim)[rank] for half in full.chunk(2, dim=0)], dim=0)
    return full.chunk(size, dim)[rank]


def full_shape(param: torch.nn.Parameter, tp: dist.ProcessGroup | None) -> torch.Size:
    shape = list(param.shape)
    if tp is not None:
        shape[param.partition_dim] *= dist.get_world_size(tp)
    return torch.Size(shape)


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's shards of single-process tensors `full` (keyed by global name)."""
    for name, param, tp in param_shards(model):
        if name not in full and name == "output_layer.weight":  # tied copy on the last stage
            name_src = "embedding.word_embeddings.weight"
        else:
            name_src = name
        shard = local_shard(name, full[name_src], param, tp, _is_gated(name, model))
        param.copy_(shard.to(param.dtype))


def _init_fn(name: str, config: TransformerConfig) -> Callable[[torch.Tensor], object]:
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return config.output_layer_init_method
    if name.startswith(("embedding.", "output_layer.")):
        return getattr(config, "embedding_init_method", None) or config.init_method
    return config.init_method


def _with_layer_offset(name: str, offset: int) -> str:
    """`decoder.layers.{i}.*` -> `decoder.layers.{i + offset}.*` (stock megatron-core numbers a
    pipeline stage's layers from 0)."""
    head, sep, tail = name.partition(_LAYERS)
    if not sep or offset == 0:
        return name
    index, _, rest = tail.partition(".")
    return f"{head}{sep}{int(index) + offset}.{rest}"


@torch.no_grad()
def init_plan_invariant(model: torch.nn.Module, seed: int, *, layer_offset: int = 0) -> None:
    """Re-initialise every >=2-D param from a global tensor seeded by (seed, global name).

    The same seed gives the same model under every plan and every backend (1-D params, norms
    and biases, are already plan-invariant constants). The tied output copy uses the
    embedding's name. `layer_offset`: global index of the model's first layer when its layers
    are numbered from 0 on each pipeline stage (stock megatron-core `GPTModel`).
    """
    config = model.config
    for local_name, param, tp in param_shards(model):
        if param.dim() < 2:
            continue
        name = _with_layer_offset(local_name, layer_offset)
        key = name
        if name == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights",
                                                     False):
            key = "embedding.word_embeddings.weight"
        state = torch.get_rng_state()
        torch.manual_seed(zlib.crc32(key.encode()) ^ seed)
        full = torch.empty(full_shape(param, tp), dtype=torch.float32)
        _init_fn(key, config)(full)
        torch.set_rng_state(state)
        param.copy_(local_shard(name, full, param, tp, _is_gated(name, model)).to(param.dtype))
