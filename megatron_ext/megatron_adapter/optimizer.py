"""Optimizer for heterogeneous plans: one megatron-core optimizer per gradient class, chained.

Each gradient class of `HeteroDDP` (params sharing a dp_cp group and ZeRO level) gets megatron-
core's own optimizer over its DDP buffers: `DistributedOptimizer` (ZeRO-1, sharded over the
class's dp_cp group) for zero=1, `FP32Optimizer` / `Float16OptimizerWithFloat16Params` otherwise
(for zero 2/3 over the FSDP2 shards, so their states are sharded too),
built by `_get_megatron_optimizer_based_on_param_groups` (optimizer/__init__.py:267). Param groups
follow `get_megatron_optimizer` (no weight decay on biases and 1-D params) but are aligned over
the world in one collective: `get_megatron_optimizer` itself does a world `all_gather_object`
per call, which would mismatch between stages holding different numbers of classes.

`HeteroChainedOptimizer` de-duplicates the global grad norm: every rank adds the squares of the
grads it owns (tensor-parallel duplicates dropped per class tp group, DDP replicas counted on
dp_cp rank 0 only, ZeRO-1/2/3 shards counted where they live, the tied output copy dropped as
`shared`), and one world all-reduce sums them.

Loss scaling (fp16's dynamic scaler, or a static --loss-scale) has one megatron-core grad scaler
for the whole chain, created as `_get_megatron_optimizer_based_on_param_groups` creates it
(optimizer/__init__.py:420: `ConstantGradScaler` for --loss-scale, else `DynamicGradScaler` with
--initial-loss-scale, --min-loss-scale, --loss-scale-window, --hysteresis under fp16) and shared
by every mixed-precision sub-optimizer. Each step every sub-optimizer's main grads (and the
FSDP2 shards of the ZeRO-2/3 classes, whose fp32 optimizer does not unscale) are unscaled and
checked for inf/NaN locally, then ONE world all-reduce (MAX) makes the found-inf decision, so
all ranks and all chained optimizers skip or step together and the scaler advances once per
step. megatron-core's own path does one all-reduce per sub-optimizer over its own group, and
`ChainedOptimizer` updates each sub-optimizer's scaler on that sub-optimizer's flag alone; with
stages holding different numbers of classes that would mismatch collectives and scales.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
from megatron.core.optimizer import (
    OptimizerConfig,
    _get_megatron_optimizer_based_on_param_groups,
    get_standard_config_overrides,
)
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    MegatronGradScaler,
)
from megatron.core.optimizer.optimizer import (
    ChainedOptimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
)
from megatron.core.optimizer_param_scheduler import (
    combine_param_group_overrides,
    param_group_override_to_tuple,
)
from torch.distributed.tensor import DTensor

from megatron_ext.megatron_adapter.compat import grads_for_grad_norm
from megatron_ext.megatron_adapter.ddp import HeteroDDP, chain_kinds
from megatron_ext.megatron_adapter.fsdp import load_optimizer_state, optimizer_sharded_state_dict

__all__ = ["HeteroChainedOptimizer", "build_optimizer", "chain_grad_scaler"]

GroupKey = tuple  # (override tuple or None, is_expert_parallel)


def _group_keys(ddp: torch.nn.Module, config: OptimizerConfig) -> dict[GroupKey, list]:
    """Params of one class by param-group key, as megatron's `_get_param_groups` maps them."""
    overrides = get_standard_config_overrides(config=config)
    found: dict[GroupKey, list] = {}
    for name, param in ddp.named_parameters():
        if not param.requires_grad:
            continue
        matches = [o for k, o in overrides.items() if k.matches(param, name)]
        override = combine_param_group_overrides(matches) if matches else None
        key = (param_group_override_to_tuple(override), not getattr(param, "allreduce", True))
        found.setdefault(key, []).append(param)
    return found


def _param_groups(keys: list[GroupKey], found: dict[GroupKey, list],
                  config: OptimizerConfig) -> list[dict]:
    groups = []
    for key in sorted(keys, key=lambda k: (k[0] is not None, k[0])):
        override_tuple, is_expert = key
        override = dict(override_tuple) if override_tuple else {}
        uses_default = not override_tuple or not any("lr" in k for k in override)
        group = {
            "params": found.get(key, []), "is_expert_parallel": is_expert,
            "default_config": uses_default, "wd_mult": 1.0, "lr_mult": 1.0,
            "is_decoupled_lr": False, "max_lr": config.lr, "min_lr": config.min_lr, **override,
        }
        # What OptimizerParamScheduler.step sets; without a scheduler megatron would decay
        # biases and norms with the optimizer-wide default.
        group["weight_decay"] = config.weight_decay * group["wd_mult"]
        groups.append(group)
    return groups


class HeteroChainedOptimizer(ChainedOptimizer):
    """`ChainedOptimizer` over classes with different ZeRO levels and groups."""

    def __init__(self, chained: list[MegatronOptimizer], config: OptimizerConfig,
                 replicated: list[bool], grad_scaler: MegatronGradScaler | None = None,
                 sharded: list[bool] | None = None, stage: int | None = None) -> None:
        # ChainedOptimizer.__init__ asserts equal configs; ours differ in use_distributed_optimizer.
        self.chained_optimizers = chained
        self.config = config
        self.model_chunks: list[torch.nn.Module] = []
        for opt in chained:
            for chunk in getattr(opt, "model_chunks", []):
                if chunk not in self.model_chunks:
                    self.model_chunks.append(chunk)
        self.is_stub_optimizer = not chained
        self._replicated = replicated
        """Per sub-optimizer: grads identical on every dp_cp rank (no ZeRO) -> count once."""
        self.stage = stage
        """This rank's pipeline stage when the stages' chains differ in kind (their states are
        then saved per stage, see `sharded_state_dict`); None otherwise."""
        self._sharded = sharded or [False] * len(chained)
        """Per sub-optimizer: it steps FSDP2 shards (a ZeRO-2/3 class)."""
        self.grad_scaler = grad_scaler
        """The chain's one loss scaler (None: no loss scaling), shared by the sub-optimizers."""
        for opt in chained:
            if isinstance(opt, MixedPrecisionOptimizer):
                opt.grad_scaler = grad_scaler
        self._scale_one = torch.ones(1)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    @staticmethod
    def _main_grads(opt: MegatronOptimizer) -> list[torch.Tensor]:
        """The fp32 grads `opt` steps on (local shards of FSDP2 DTensors), after the copy from
        the model grads that megatron's `prepare_grads` does."""
        if isinstance(opt, MixedPrecisionOptimizer):
            opt._copy_model_grads_to_main_grads()
            return opt._collect_main_grad_data_for_unscaling() or []
        opt.prepare_grads()  # FP32Optimizer: main_grad -> grad, no collective
        grads = [p.grad for group in opt.param_groups for p in group["params"]
                 if p.grad is not None]
        return [g.to_local() if isinstance(g, DTensor) else g for g in grads]

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Copy to main grads, unscale, and decide found-inf once for the whole chain and the
        whole world (module docstring). Without a scaler: megatron's own per-optimizer path."""
        if self.grad_scaler is None:
            return super().prepare_grads()
        found_inf = torch.zeros(1, dtype=torch.float)
        for opt in self.chained_optimizers:
            grads = self._main_grads(opt)
            if grads:
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, found_inf, self.grad_scaler.inv_scale.to(grads[0].device))
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        found = bool(found_inf.item() > 0)
        self.grad_scaler.update(found)
        return found

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           **kwargs: Any) -> dict:
        """megatron-core's, with the ZeRO-2/3 classes' states in the weights' own keys
        (fsdp.optimizer_sharded_state_dict).

        dist_checkpointing keeps only rank 0's non-tensor ("common") part and gives it to every
        rank on load, which fits only if every stage chains the same kinds of optimizer. When
        they differ (`stage` set), the chain is saved as {"stage<p>": chain of stage p}: the
        common parts of all stages are gathered (collective over the world when saving), so
        rank 0 writes every stage's, and each rank loads its own stage's entry."""
        if not any(self._sharded) and self.stage is None:
            return super().sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        states = []
        for opt, sharded in zip(self.chained_optimizers, self._sharded):
            if sharded:
                states.append(optimizer_sharded_state_dict(opt, model_sharded_state_dict,
                                                           is_loading))
            else:
                states.append(opt.sharded_state_dict(model_sharded_state_dict, is_loading,
                                                     **kwargs))
        own = states[0] if len(states) == 1 else dict(enumerate(states))
        if self.stage is None:
            return own
        out = {f"stage{self.stage}": own}
        if not is_loading:
            _, common = extract_matching_values(
                own, lambda v: isinstance(v, ShardedBase | LocalNonpersistentObject),
                return_lists_as_dicts=False)  # as megatron splits it (save_preprocess)
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (self.stage, common))
            for stage, stage_common in gathered:
                out.setdefault(f"stage{stage}", stage_common)
        return out

    def load_state_dict(self, state_dict: Any) -> None:
        full = state_dict  # every stage's entry: the scaler is in those with a Float16/ZeRO-1 one
        if self.stage is not None:
            state_dict = state_dict[f"stage{self.stage}"]
        if not any(self._sharded) and self.stage is None:
            super().load_state_dict(state_dict)
        else:
            states = [state_dict] if len(self.chained_optimizers) == 1 else [
                v for _, v in sorted(state_dict.items())]
            if len(states) != len(self.chained_optimizers):
                raise RuntimeError(f"Expected {len(self.chained_optimizers)} entries in state "
                                   f"dict, but got {len(states)}.")
            for opt, sharded, state in zip(self.chained_optimizers, self._sharded, states):
                if sharded:
                    load_optimizer_state(opt, state)
                else:
                    opt.load_state_dict(state)
        if self.grad_scaler is not None:  # rank 0's scaler state, the same on every rank
            saved = _find_grad_scaler_state(full)
            if saved is not None:
                self.grad_scaler.load_state_dict(saved)

    def has_grad_norm_group(self, grad_norm_group: str) -> bool:
        """False: no parameter here belongs to a separately normed group (megatron-core 0.19's
        multi-token-prediction heads; the MTP flags are refused). 0.19's `ChainedOptimizer.step`
        asks once per group with a collective over each sub-optimizer's own group
        (optimizer.py:1816, :316); the classes here differ by rank (pipeline stage, ZeRO
        level), so those collectives would not match across ranks. The grad norm itself is
        `get_grad_norm` below, over the whole world, as on 0.16."""
        return False

    def _owned_grads(self) -> list[torch.Tensor]:
        grads: list[torch.Tensor] = []
        for opt, replicated in zip(self.chained_optimizers, self._replicated):
            if replicated and dist.get_rank(opt.data_parallel_group_for_norm) != 0:
                continue
            grads += grads_for_grad_norm(opt)
        return grads

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        return get_grad_norm_fp32(self._owned_grads(), grad_stats_parallel_group=dist.group.WORLD)

    @torch.no_grad()
    def count_zeros(self) -> float:
        zeros = torch.zeros(1, dtype=torch.float64)
        for grad in self._owned_grads():
            zeros += (grad == 0).sum().item()
        dist.all_reduce(zeros)
        return float(zeros.item())


def _find_grad_scaler_state(state: Any, depth: int = 3) -> dict | None:
    """The first 'grad_scaler' entry in a (chained, possibly per-stage) optimizer state."""
    if not isinstance(state, dict) or depth < 0:
        return None
    if state.get("grad_scaler") is not None:
        return state["grad_scaler"]
    for value in state.values():
        found = _find_grad_scaler_state(value, depth - 1)
        if found is not None:
            return found
    return None


def chain_grad_scaler(config: OptimizerConfig, sharded: bool) -> MegatronGradScaler | None:
    """The loss scaler megatron-core's optimizer factory gives a mixed-precision or distributed
    optimizer (optimizer/__init__.py:420), or None where it gives none (fp32 without ZeRO: its
    FP32Optimizer does not scale). `sharded`: the plan has ZeRO layers anywhere (the same
    answer on every rank, so every rank takes part in the found-inf all-reduce)."""
    if not (config.fp16 or config.bf16 or sharded):
        return None
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
            growth_factor=2.0, backoff_factor=0.5, growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis)
    return None


def build_optimizer(chunks: list[HeteroDDP], config: OptimizerConfig) -> HeteroChainedOptimizer:
    """Optimizer for `build_model`'s chunks. Collective over the world (param-group alignment)."""
    classes = [(chunk, cls, ddp) for chunk in chunks for cls, ddp in zip(chunk.classes,
                                                                         chunk.ddps)]
    found = [_group_keys(ddp, config) for _, _, ddp in classes]
    local: dict[tuple, list] = {}  # model chunks of one class share its keys
    for (_, cls, _), keys in zip(classes, found):
        local.setdefault(cls.key, [])
        local[cls.key] += [k for k in keys if k not in local[cls.key]]
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, local)
    chained, replicated, sharded = [], [], []
    for (_chunk, cls, ddp), keys in zip(classes, found):
        union = list(dict.fromkeys(k for g in gathered for k in g.get(cls.key, [])))
        cls_config = dataclasses.replace(config, use_distributed_optimizer=cls.zero == 1)
        if cls.zero >= 2:  # fp32 shards are the master weights (fsdp.py)
            cls_config = dataclasses.replace(cls_config, bf16=False, fp16=False)
        opt = _get_megatron_optimizer_based_on_param_groups(
            config=cls_config, model_chunks=[ddp], param_groups=_param_groups(union, keys, config),
            per_model_buffers={0: ddp.buffers} if cls.zero <= 1 else None,
            model_parallel_group=None,
            data_parallel_group=cls.pg_collection.dp_cp, data_parallel_group_gloo=None,
            data_parallel_group_idx=0, intra_dist_opt_group=dist.group.WORLD,
            distributed_optimizer_instance_id=0, pg_collection=cls.pg_collection,
        )
        opt.data_parallel_group_for_norm = cls.pg_collection.dp_cp
        chained.append(opt)
        replicated.append(cls.zero == 0)
        sharded.append(cls.zero >= 2)
    inner = chunks[0].module
    plan = inner.plan
    scaler = chain_grad_scaler(config, any(s.zero >= 1 for s in plan.layers))
    stage = inner.groups.stage if len(set(chain_kinds(plan))) > 1 else None
    return HeteroChainedOptimizer(chained, config, replicated, scaler, sharded, stage)
