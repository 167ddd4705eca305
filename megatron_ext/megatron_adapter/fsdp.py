"""ZeRO-2 / ZeRO-3 for one gradient class of layers: PyTorch FSDP2 `fully_shard` per layer on
the class's own data-parallel (dp_cp) group.

Each `TransformerLayer` of the class becomes an FSDP2 module over a `DeviceMesh` built from the
class's dp_cp group (`DeviceMesh.from_group`, device type from the parameters: "cpu" under gloo),
so its parameters, gradients and optimizer states are dim-0 shards (DTensors) of the layer's
tensor-parallel shard:

- zero=3: parameters all-gathered before the layer's forward, freed after it
  (`reshard_after_forward=True`), gathered again for its backward;
- zero=2: gathered once per micro-batch for forward and kept until the layer's backward has
  run (`reshard_after_forward=False`, FSDP's SHARD_GRAD_OP), so the backward needs no second
  gather; at rest between steps the parameters are shards as under zero=3.

Gradients are reduce-scattered in each layer's backward (every micro-batch: megatron's `no_sync`
is not applied, so no full-size gradient is ever kept) and summed, not averaged
(`set_gradient_divide_factor(1.0)`): the runtime's loss is per token and `finalize_grads` divides
by the global token count, as for the DDP classes. Adjacent sharded layers of a stage prefetch
each other's all-gather (forward: the next layer, backward: the previous one).

Under bf16 the shards are fp32 and are the master weights: FSDP2 gathers them in bf16
(`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`) and reduce-scatters fp32
gradients, so megatron-core's `FP32Optimizer` steps them as they are (over the DTensors:
states are created per shard; grad norms read the local shards through megatron's
`__fsdp_param__` convention, optimizer/optimizer.py:148). megatron's own FSDP2 wrapper
(distributed/torch_fully_sharded_data_parallel.py) takes one group for the whole model and a
"cuda" mesh, so it is not used; its save/restore of custom parameter attributes
(pytorch/pytorch#136929) is followed here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["ShardedLayers", "layer_sharded_state_dict", "load_optimizer_state",
           "optimizer_sharded_state_dict", "shard_full_state", "shard_root", "sharded_params"]


def _custom_attrs(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    return {name: dict(vars(p)) for name, p in module.named_parameters()}


class ShardedLayers(_BaseDataParallel):
    """Layers of one (tp, zero>=2) gradient class, each `fully_shard`ed over `group`.

    Presents the DDP API `HeteroDDP` drives (no_sync, grad sync, scaling, zeroing); gradient
    reduction itself happens inside FSDP2's backward hooks.
    """

    def __init__(self, config: TransformerConfig, layers: list[torch.nn.Module], *,
                 group: dist.ProcessGroup, zero: int) -> None:
        assert zero in (2, 3), zero
        module = torch.nn.ModuleList(layers)
        super().__init__(config=config, module=module)
        self.ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False)
        self.zero = zero
        self.group = group
        device = next(module.parameters()).device
        self.mesh = DeviceMesh.from_group(group, device.type)
        attrs = _custom_attrs(module)
        compute_dtype = config.params_dtype
        policy = MixedPrecisionPolicy()
        if compute_dtype != torch.float32:  # fp32 shards are the master weights
            with torch.no_grad():
                for param in module.parameters():
                    param.data = param.data.float()
            policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mesh=self.mesh, reshard_after_forward=zero == 3, mp_policy=policy)
            layer.set_gradient_divide_factor(1.0)
            layer.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
        for name, param in module.named_parameters():
            for key, value in attrs.get(name, {}).items():
                setattr(param, key, value)
            param.__fsdp_param__ = True  # megatron reads local grad shards for norms
        self.layers: list[FSDPModule] = layers

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients are reduce-scattered every micro-batch (kept sharded): nothing to defer."""
        yield

    def start_grad_sync(self, *unused: Any) -> None:
        pass

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        pass  # FSDP2's post-backward callback has waited for the reduce-scatters

    def start_param_sync(self, *unused: Any, force_sync: bool = False,
                         force_dispatch: bool = False) -> None:
        pass  # parameters are gathered by each layer's forward pre-hook

    def scale_gradients(self, scaling_factor: float) -> None:
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        for param in self.module.parameters():
            param.grad = None

    def broadcast_params(self) -> None:
        pass  # each replica's shard is cut from its own full tensor; identical under
        # plan-invariant init, and a consistent (if different) init otherwise

    def local_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """This rank's shard of a parameter's summed gradient."""
        return None if param.grad is None else param.grad.to_local()

    def reshard(self) -> None:
        """Free gathered weights: a ZeRO-2 layer keeps them after a forward without backward
        (evaluation) until its next backward."""
        for layer in self.layers:
            layer.reshard()


def shard_root(block: torch.nn.Module, classes: list[ShardedLayers]) -> None:
    """Make `block` (the stage's decoder) the FSDP2 root of its sharded layers, holding no
    parameters itself (the DDP classes' parameters are ignored): the root's forward initialises
    every layer's FSDP state in one context, so layers can prefetch each other, and its
    post-backward callback waits for every reduce-scatter.

    Prefetch is explicit along the stage's sharded layers in run order (forward: the next one,
    backward: the previous one), as megatron's FSDP2 wrapper sets it, so that activation
    recomputation does not disturb FSDP2's recorded order."""
    if not classes:
        return
    mine = {id(p) for cls in classes for p in cls.module.parameters()}
    ignored = {p for p in block.parameters() if id(p) not in mine}
    fully_shard(block, mesh=classes[0].mesh, ignored_params=ignored)
    sharded = {id(layer) for cls in classes for layer in cls.layers}
    order = [layer for layer in block.layers if id(layer) in sharded]
    for prev, nxt in zip(order, order[1:]):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])


def layer_sharded_state_dict(layer: torch.nn.Module, *args: Any) -> dict:
    """Checkpoint hook: `layer.sharded_state_dict(*args)` of a ZeRO-2/3 layer as if it were a
    DDP layer: its FSDP2 shards are swapped for the full tensor-parallel shards (an all-gather
    over the layer's dp_cp group) while megatron builds the state dict, so it saves and loads
    under the same global keys, shapes and offsets, and checkpoints reshard to and from any
    plan. (megatron's own DTensor path, utils.py:966, cuts dim 0 by dp rank, which is wrong for
    the gated fc1 [gate; up] factory and for FSDP2's padded uneven shards.) Collective: every
    rank of the stage calls it in the same order."""
    if not isinstance(layer, FSDPModule):
        return layer.sharded_state_dict(*args)
    layer.reshard()  # e.g. a ZeRO-2 layer after a forward-only pass
    swapped = []
    for module in layer.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                full = torch.nn.Parameter(param.full_tensor().detach(),
                                          requires_grad=param.requires_grad)
                for key, value in vars(param).items():
                    if not key.startswith("_"):  # megatron's tp attributes, not DTensor's own
                        setattr(full, key, value)
                full._megatron_ext_shard = param  # optimizer_sharded_state_dict finds it
                module._parameters[name] = full  # FSDP2 stays "sharded": its hook is a no-op
                swapped.append((module, name, param))
    try:
        return layer.sharded_state_dict(*args)
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def shard_full_state(module: torch.nn.Module, state_dict: dict) -> dict:
    """Checkpoint hook for loading: full tensors of `state_dict` whose parameter in `module` is
    an FSDP2 shard become that shard (cut locally, no communication)."""
    params = dict(module.named_parameters())
    out = dict(state_dict)
    for key, value in state_dict.items():
        param = params.get(key)
        if isinstance(param, DTensor) and torch.is_tensor(value) and not isinstance(value,
                                                                                  DTensor):
            out[key] = distribute_tensor(value.to(param.dtype), param.device_mesh,
                                         param.placements, src_data_rank=None)
    return out


def sharded_params(chunks: list[torch.nn.Module]) -> set[int]:
    """ids of the parameters held by `ShardedLayers` classes of `HeteroDDP` chunks."""
    return {id(p) for chunk in chunks for ddp in getattr(chunk, "ddps", [])
            if isinstance(ddp, ShardedLayers) for p in ddp.module.parameters()}


def optimizer_sharded_state_dict(opt: Any, model_sharded_state_dict: dict,
                                 is_loading: bool = False) -> dict:
    """megatron-core `FP32Optimizer.sharded_state_dict` for the optimizer of a ZeRO-2/3 class.

    Its parameters are FSDP2 shards, which the model's sharded state dict does not hold (it
    holds full tensor-parallel shards, `layer_sharded_state_dict`), so megatron's id map finds
    none of them. Each moment is saved as the model's weight is: gathered to the full
    tensor-parallel shard and keyed `optimizer.state.{exp_avg,exp_avg_sq}.<weight key>` with the
    weight's global shape, offsets and replica ids, the keys every other optimizer of
    megatron-core and of this runtime uses, so the moments reshard to other dp/tp degrees and
    ZeRO levels with the same layout. Collective over each class's dp_cp group when saving
    (`DTensor.full_tensor`); loading asks for full-shaped buffers and `load_optimizer_state`
    cuts this rank's shard."""
    if is_loading:
        opt.init_state_fn(opt.optimizer, opt.config)
    state_dict = opt.state_dict()
    by_shard = {}
    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    for item in nested_values(tensors):
        shard = getattr(item.data, "_megatron_ext_shard", None)
        if shard is not None:
            by_shard[id(shard)] = item
    step = opt._extract_common_per_param_step(state_dict)
    sharded_state = {}
    for index, param in enumerate(opt.get_parameters()):
        entry = {}
        for key, value in state_dict["state"].get(index, {}).items():
            if key == "step":
                continue
            if isinstance(value, DTensor):
                value = (torch.empty(value.shape, dtype=value.dtype) if is_loading
                         else value.full_tensor())
            entry[key] = make_sharded_optimizer_tensor(by_shard[id(param)], value,
                                                       prefix=f"optimizer.state.{key}")
        sharded_state[index] = entry
    state_dict["state"] = sharded_state
    state_dict["param_groups"] = [
        {**group, "params": LocalNonpersistentObject(group["params"])}
        for group in state_dict["param_groups"]]
    if step is not None:
        state_dict["state"]["common_step"] = step
    return state_dict


def load_optimizer_state(opt: Any, state_dict: dict) -> None:
    """Load what `optimizer_sharded_state_dict` described: full moments become this rank's
    FSDP2 shards of them (cut locally), then megatron's `FP32Optimizer.load_state_dict`."""
    params = opt.get_parameters()
    for index, entry in state_dict["state"].items():
        if not isinstance(index, int):
            continue
        param = params[index]
        for key, value in entry.items():
            if isinstance(param, DTensor) and torch.is_tensor(value) and not isinstance(
                    value, DTensor) and key != "step":
                entry[key] = distribute_tensor(value.to(param.dtype), param.device_mesh,
                                               param.placements, src_data_rank=None)
    opt.load_state_dict(state_dict)
