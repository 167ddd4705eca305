"""Optimizer state keyed by parameter, independent of the plan that wrote it.

A checkpoint's `optimizer` entry (`PARAM_KEYED`) holds, for every parameter of the model:

- `optimizer.state.exp_avg.<weight key>` and `optimizer.state.exp_avg_sq.<weight key>` (Adam's
  moments; whatever tensor state the torch optimizer keeps, e.g. `max_exp_avg_sq` under
  amsgrad or SGD's `momentum_buffer`), and under bf16/fp16 `optimizer.state.param.<weight
  key>`, the fp32 master copy. Each is a megatron-core ShardedTensor with the weight's own global
  key, shape, tensor-parallel offsets and replica ids (`make_sharded_optimizer_tensor`), the
  model-space tensors of megatron-core's `fully_reshardable` distributed-optimizer format
  (distrib_optimizer.py `sharded_param_state_fully_reshardable`), so `dist_checkpointing`
  reshards them to any tensor/pipeline/data/expert-parallel layout exactly as it reshards the
  weights.
- in the common part: the optimizer `step` (one count: every parameter steps together), each
  param group's hyper-parameters by group (`_group_id`: weight-decay and lr multipliers,
  expert-parallel, decoupled lr, which are properties of the parameter, not of the plan) and
  the loss scaler's state.

megatron-core keeps the non-tensor part of a (chained) optimizer per optimizer object (one entry
per chained optimizer, param groups by position), so its format reloads only into the same
number and kind of optimizers. Here nothing depends on how a plan groups parameters: DDP
classes (torch Adam over the parameters, or over fp32 copies of bf16 ones), ZeRO-1
DistributedOptimizer ranges of flat buffers, ZeRO-2/3 FSDP2 shards (DTensors), expert classes,
pipeline chunks, or megatron-core's own optimizer under the stock and FlexSP backends. Saving
gathers each parameter's full tensor-parallel shard of state (the distributed optimizer over
its data-parallel group as megatron-core does, FSDP2 shards with `full_tensor`); loading reads
the full tensor-parallel shard each rank's parameters need and cuts its own range or shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from torch.distributed.tensor import DTensor, distribute_tensor

from megatron_ext.errors import PlanError

PARAM_KEYED = "param_keyed"
"""Recorded as megatron_ext.optimizer_layout and optimizer["layout"]."""
PARAM_KEYED_VERSION = 1
PREFIX = "optimizer.state"
MASTER = "param"
"""megatron-core's name for the fp32 master copy in the fully_reshardable format."""
GROUP_ID_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


@dataclasses.dataclass(kw_only=True, slots=True)
class Slot:
    """One parameter's optimizer state on this rank."""

    opt: Any
    """The megatron-core optimizer (one of a chain) stepping it."""
    item: Any
    """The weight's ShardedTensor (or factory) in the model's sharded state dict."""
    model_param: torch.Tensor
    """The model's parameter (an FSDP2 DTensor for ZeRO-2/3 classes)."""
    main: torch.Tensor | None
    """The tensor torch's optimizer steps: the parameter itself, its fp32 copy, a DTensor
    shard, or (ZeRO-1) this rank's flat range of it; None for a ZeRO-1 parameter whose range
    lies on other ranks."""
    kind: str
    """'local' (whole tensor-parallel shard), 'dtensor' (FSDP2 shard) or 'range' (ZeRO-1)."""
    span: tuple[int, int] | None = None
    """kind 'range': the flat range of the parameter `main` holds (None: none here)."""

    @property
    def state(self) -> dict[str, Any]:
        return {} if self.main is None else self.opt.optimizer.state[self.main]

    def names(self) -> list[str]:
        """Its state tensors' names ('step' aside); a ZeRO-1 parameter held elsewhere: those of
        any parameter of its optimizer (all alike)."""
        state = self.state
        if self.main is None:
            state = next((v for v in self.opt.optimizer.state.values() if v), {})
        return sorted(k for k, v in state.items() if k != "step" and torch.is_tensor(v))


def inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def mixed_precision(optimizer: Any) -> bool:
    config = getattr(optimizer, "config", None)
    return bool(getattr(config, "bf16", False) or getattr(config, "fp16", False))


def _items_by_param(model_sd: dict) -> dict[int, Any]:
    tensors, _ = extract_sharded_tensors_and_factories(model_sd)
    found = {}
    for item in nested_values(tensors):
        found[id(item.data)] = item
        shard = getattr(item.data, "_megatron_ext_shard", None)  # fsdp.layer_sharded_state_dict
        if shard is not None:
            found[id(shard)] = item
    return found


def _item(items: dict[int, Any], param: torch.Tensor) -> Any:
    try:
        return items[id(param)]
    except KeyError:
        raise RuntimeError(f"a parameter of shape {tuple(param.shape)} has no entry in the "
                           "model's sharded state dict") from None


def slots(optimizer: Any, model_sd: dict) -> list[Slot]:
    """Every parameter this rank's optimizers step, in a deterministic order (the same on every
    rank of a data-parallel group: `full_tensor` gathers follow it)."""
    items = _items_by_param(model_sd)
    out = []
    for opt in inner_optimizers(optimizer):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        if isinstance(opt, DistributedOptimizer):
            # every parameter of its buffers, also those whose range lies on other data-parallel
            # ranks (span None): each parameter's state needs a main replica among the loads
            local = {}
            for gbuf_range_maps in opt.gbuf_ranges:
                for range_maps in gbuf_range_maps.values():
                    for range_map in range_maps:
                        local.update(range_map["param_map"])
            for buffer in opt.buffers:
                for param in buffer.param_index_map:
                    main, span = None, None
                    if param in local:
                        group, order = opt.model_param_group_index_map[param]
                        main = opt.optimizer.param_groups[group]["params"][order]
                        span = (local[param]["param"].start, local[param]["param"].end)
                    out.append(Slot(opt=opt, item=_item(items, param), model_param=param,
                                    main=main, kind="range", span=span))
            continue
        if isinstance(opt, Float16OptimizerWithFloat16Params):
            pairs = [(m, p) for mg, pg in zip(opt.float16_groups, opt.fp32_from_float16_groups)
                     for m, p in zip(mg, pg)]
            pairs += [(p, p) for group in opt.fp32_from_fp32_groups for p in group]
        else:  # FP32Optimizer: steps the parameters themselves
            pairs = [(p, p) for group in opt.optimizer.param_groups for p in group["params"]]
        for param, main in pairs:
            kind = "dtensor" if isinstance(main, DTensor) else "local"
            out.append(Slot(opt=opt, item=_item(items, param), model_param=param, main=main,
                            kind=kind))
    return out


@torch.no_grad()
def materialize_state(optimizer: Any) -> None:
    """Give torch Adam parameters that have never been stepped the state Adam's first step
    creates (step 0, zero moments; torch/optim/adam.py `_init_group`), so a save before the
    first successful step (fp16 skips them until the loss scale has come down) and a load into
    a fresh optimizer have every tensor to write into. Adam then behaves exactly as with lazy
    state."""
    for opt in inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if inner.state[param]:
                    continue
                zeros = {"exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                         "exp_avg_sq": torch.zeros_like(param,
                                                        memory_format=torch.preserve_format)}
                if group.get("amsgrad"):
                    zeros["max_exp_avg_sq"] = torch.zeros_like(param)
                inner.state[param] = {"step": torch.tensor(0.0, dtype=torch.float32), **zeros}


def _group_id(group: dict) -> str:
    """A param group's identity that does not depend on the plan (GROUP_ID_KEYS)."""
    return ",".join(f"{k}={group.get(k)}" for k in GROUP_ID_KEYS)


def _hyper_parameters(group: dict) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params" and (
        isinstance(v, bool | int | float | str | type(None))
        or (isinstance(v, tuple) and all(isinstance(x, int | float) for x in v)))}


def _step_count(all_slots: list[Slot]) -> int:
    """The step every parameter has taken (the same everywhere; MAX over the world so rank 0,
    which writes the common part, has it even if it held no stepped parameter)."""
    steps = [float(s.state["step"]) for s in all_slots if "step" in s.state]
    found = torch.tensor([max(steps, default=0.0)], dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return int(found.item())


def _grad_scaler(optimizer: Any) -> Any:
    for opt in [optimizer, *inner_optimizers(optimizer)]:
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None:
            return scaler
    return None


def save_state(optimizer: Any, model_sd: dict) -> dict[str, Any]:
    """The optimizer's entry of a checkpoint being saved (module docstring). Collective over
    the world (step count, param groups) and every class's data-parallel group (gathers)."""
    materialize_state(optimizer)
    all_slots = slots(optimizer, model_sd)
    master = mixed_precision(optimizer)
    tensors: dict[str, Any] = {}
    distopt_done: set[int] = set()
    for slot in all_slots:
        if slot.kind == "range":  # megatron-core's own gather, once per distributed optimizer
            if id(slot.opt) not in distopt_done:
                distopt_done.add(id(slot.opt))
                _save_distopt(slot.opt, model_sd, tensors, master)
            continue
        for name in slot.names():
            value = slot.state[name]
            value = value.full_tensor() if isinstance(value, DTensor) else value
            _put(tensors, make_sharded_optimizer_tensor(slot.item, value,
                                                        prefix=f"{PREFIX}.{name}"))
        if master and slot.main is not None:  # DDP's fp32 copy, or a ZeRO-2/3 fp32 shard
            # (the master weight itself)
            value = slot.main.full_tensor() if isinstance(slot.main, DTensor) else slot.main
            _put(tensors, make_sharded_optimizer_tensor(slot.item, value.detach().float(),
                                                        prefix=f"{PREFIX}.{MASTER}"))
    groups: dict[str, dict] = {}
    for opt in inner_optimizers(optimizer):
        for group in getattr(getattr(opt, "optimizer", None), "param_groups", []):
            groups.setdefault(_group_id(group), _hyper_parameters(group))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, groups)
    for other in gathered:
        for key, value in other.items():
            groups.setdefault(key, value)
    scaler = _grad_scaler(optimizer)
    return {"layout": PARAM_KEYED, "version": PARAM_KEYED_VERSION, "state": tensors,
            "step": _step_count(all_slots), "param_groups": groups,
            "grad_scaler": None if scaler is None else scaler.state_dict()}


def _save_distopt(opt: DistributedOptimizer, model_sd: dict, out: dict, master: bool) -> None:
    """megatron-core's fully_reshardable model-space tensors of one distributed optimizer
    (gathered over its data-parallel group), without `param` under fp32 (there the main
    parameter is the model's weight, saved with the model)."""
    states = opt.sharded_param_state_fully_reshardable(model_sd, is_loading=False, metadata={})
    for per_param in states.values():
        for name, sharded in per_param.items():
            if name == MASTER and not master:
                continue
            _put(out, sharded)


def _put(out: dict[str, Any], sharded: Any) -> None:
    """Add under a name unique on this rank: a rank may hold several shards of one key (the
    local experts of a layer are one tensor with an expert axis)."""
    out[f"{sharded.key}#{len(out)}"] = sharded


def load_request(optimizer: Any, model_sd: dict, saved_keys: set[str],
                 root: str) -> tuple[dict[str, Any], list[Slot]]:
    """The optimizer entry to pass to `dist_checkpointing.load`: for each of this rank's
    parameters, its full tensor-parallel shard of every state tensor its optimizer keeps (and
    of the master copy where the checkpoint has one). `saved_keys`: the checkpoint's tensor
    keys. Returns the entry and the slots to pass to `restore` (dist_checkpointing.load
    rewrites the model's sharded state dict)."""
    materialize_state(optimizer)
    tensors: dict[str, Any] = {}
    found = slots(optimizer, model_sd)
    for index, slot in enumerate(found):
        like = slot.item.data
        for name in [*slot.names(), MASTER]:
            key = f"{PREFIX}.{name}.{slot.item.key}"
            if key not in saved_keys:
                if name == MASTER:
                    continue
                raise PlanError(f"--load={root} has no {key}; the checkpoint was written by "
                                "another optimizer (--optimizer) or without this parameter: "
                                "add --no-load-optim to restart the optimizer state")
            buffer = torch.empty(like.shape, dtype=torch.float32, device=like.device)
            tensors[f"{index}.{name}"] = make_sharded_optimizer_tensor(slot.item, buffer,
                                                         prefix=f"{PREFIX}.{name}")
    return {"state": tensors}, found


@torch.no_grad()
def restore(optimizer: Any, found: list[Slot], loaded: dict[str, Any]) -> None:
    """Copy a loaded `load_request` entry into this rank's optimizer state: each slot's range
    (ZeRO-1) or FSDP2 shard of the full tensors, the step count, param-group hyper-parameters
    and the loss scaler. Runs after the model's weights were loaded (a master copy the
    checkpoint lacks is taken from them)."""
    tensors = loaded["state"]
    step = torch.tensor(float(loaded["step"]), dtype=torch.float32)
    for index, slot in enumerate(found):
        if slot.main is None:
            continue
        state = slot.state
        for name in [*slot.names(), MASTER]:
            full = tensors.get(f"{index}.{name}")
            if full is None:  # no master copy saved (fp32 run): the loaded weight is it
                if name != MASTER or slot.main is slot.model_param:
                    continue
                full = _full_weight(slot)
            target: Any = slot.main if name == MASTER else state[name]
            if slot.span is not None:  # ZeRO-1: this rank's flat range
                target.copy_(full.reshape(-1)[slot.span[0]:slot.span[1]])
            elif slot.kind == "dtensor":
                cut = distribute_tensor(full.to(target.dtype), target.device_mesh,
                                        target.placements, src_data_rank=None)
                target.to_local().copy_(cut.to_local())
            else:
                target.copy_(full)
        if "step" in state:
            state["step"] = step.clone() if torch.is_tensor(state["step"]) else int(step)
    groups = loaded.get("param_groups") or {}
    for opt in inner_optimizers(optimizer):
        for group in getattr(getattr(opt, "optimizer", None), "param_groups", []):
            saved = groups.get(_group_id(group))
            if saved is not None:
                group.update({k: v for k, v in saved.items() if k in group})
    scaler, saved_scaler = _grad_scaler(optimizer), loaded.get("grad_scaler")
    if scaler is not None and saved_scaler is not None:
        scaler.load_state_dict(saved_scaler)


def _full_weight(slot: Slot) -> torch.Tensor:
    param = slot.model_param
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().float()
