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
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core.optimizer import (
    OptimizerConfig,
    _get_megatron_optimizer_based_on_param_groups,
    get_standard_config_overrides,
)
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import (
    combine_param_group_overrides,
    param_group_override_to_tuple,
)

from megatron_ext.megatron_adapter.ddp import HeteroDDP

__all__ = ["HeteroChainedOptimizer", "build_optimizer"]

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
                 replicated: list[bool]) -> None:
        # ChainedOptimizer.__init__ asserts equal configs; ours differ in use_distributed_optimizer.
        self.chained_optimizers = chained
        self.config = config
        self.model_chunks = []
        for opt in chained:
            for chunk in getattr(opt, "model_chunks", []):
                if chunk not in self.model_chunks:
                    self.model_chunks.append(chunk)
        self.is_stub_optimizer = not chained
        self._replicated = replicated
        """Per sub-optimizer: grads identical on every dp_cp rank (no ZeRO) -> count once."""

    def _owned_grads(self) -> list[torch.Tensor]:
        grads: list[torch.Tensor] = []
        for opt, replicated in zip(self.chained_optimizers, self._replicated):
            if replicated and dist.get_rank(opt.data_parallel_group_for_norm) != 0:
                continue
            grads += opt.get_main_grads_for_grad_norm()
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


def build_optimizer(chunks: list[HeteroDDP], config: OptimizerConfig) -> HeteroChainedOptimizer:
    """Optimizer for `build_model`'s chunks. Collective over the world (param-group alignment)."""
    classes = [(chunk, cls, ddp) for chunk in chunks for cls, ddp in zip(chunk.classes,
                                                                         chunk.ddps)]
    found = [_group_keys(ddp, config) for _, _, ddp in classes]
    local = {(cls.tp, cls.zero): list(keys) for (_, cls, _), keys in zip(classes, found)}
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, local)
    chained, replicated = [], []
    for (_chunk, cls, ddp), keys in zip(classes, found):
        union = list(dict.fromkeys(k for g in gathered for k in g.get((cls.tp, cls.zero), [])))
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
    return HeteroChainedOptimizer(chained, config, replicated)
