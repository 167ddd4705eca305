"""Gradient synchronisation for a model whose layers sit in different data-parallel groups.

megatron-core's `DistributedDataParallel` reduces all dense params over one group. The
replicas of a parameter shard of a layer with tensor-parallel degree tp are the stage ranks with
the same tp rank (its dp x cp x Ulysses ranks), so the gradient group depends on tp alone.
`HeteroDDP` wraps the stage model once and holds one stock DDP per (tp, zero) class of layers
(plus the vocabulary layers, classed by vocab.tp and the zero level of their neighbour layer,
at most 1), each over its own `dp_cp` group with its own bucketing/overlap, and ZeRO-1
(`use_distributed_optimizer`) per class. Classes with zero 2 or 3 are FSDP2-sharded layers
(`fsdp.ShardedLayers`) over the same group instead of a DDP. The DDPs own no forward: their
per-parameter hooks and buffers work on the shared layer modules. The API mirrors DDP, so
megatron-core schedules and `finalize_grads` treat it as one model chunk.

Mixture-of-Experts layers: the routed experts (`mlp.experts`) of MoE layers with the same
(ep, etp, zero) form their own class, over the expert-data-parallel group of (ep, etp) (the
replicas of a rank's expert shards, runtime/groups.py); the rest of the layer (attention,
norms, router, shared experts) stays in its (tp, zero) class. megatron-core's single DDP has one
expert buffer family over one group (distributed_data_parallel.py:109-125), so layers with
different expert-DP groups need a DDP each; inside its own DDP an expert class is reduced as
"dense" params over that group (its params are tagged `allreduce=True`): megatron-core tags them
`allreduce=False` only for EP > 1, which at EP = 1 with etp != tp would reduce them over the
attention's group instead (layers.py:829/886/1149/1209).

Loss scaling: the runtime always uses per-token loss (`calculate_per_token_loss`): DDPs sum
gradients and `finalize_grads` divides by the global token count. Averaging per data-parallel
group would be wrong when layers have different dp degrees.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.distributed.finalize_model_grads import (
    _allreduce_non_tensor_model_parallel_grads,
    _allreduce_word_embedding_grads,
    reset_model_temporary_tensors,
)
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_ext.megatron_adapter.fsdp import ShardedLayers, shard_root
from megatron_ext.megatron_adapter.model import HeteroGPTModel

__all__ = ["GradClass", "HeteroDDP", "chain_kinds", "finalize_grads", "force_param_sync",
           "stage_class_keys",
           "vocab_zero"]


def vocab_zero(layer_zero: int) -> int:
    """ZeRO level of the vocabulary layers next to a layer with `layer_zero`: they keep
    megatron's DDP (the embedding is tied across stages and sits outside the layer loop), with
    the distributed optimizer when the neighbour shards anything."""
    return min(layer_zero, 1)


def stage_class_keys(plan: Any, chunk: int) -> list[tuple]:
    """(tp, zero, expert) of the gradient classes of model chunk `chunk` (an entry of
    plan.stages), in `grad_classes`' order (the order of its chained optimizers), from the plan
    alone."""
    start, end = plan.stages[chunk]
    vocab_parallel = plan.vocab.mode == "vocab_parallel"
    wanted: list[tuple] = [(plan.vocab.tp, vocab_zero(plan.layers[start].zero), None)] if (
        chunk == 0 and not vocab_parallel) else []
    for i in range(start, end):
        s = plan.layers[i]
        wanted.append((s.tp, s.zero, None))
        if plan.model.is_moe_layer(i):
            wanted.append((s.expert_tp, s.zero, (s.ep, s.expert_tp)))
    if chunk == len(plan.stages) - 1:  # final norm (and the output layer unless vocab-parallel)
        wanted.append((plan.vocab.tp, vocab_zero(plan.layers[end - 1].zero), None))
    if vocab_parallel:
        wanted.append((plan.vocab.tp, vocab_zero(plan.layers[start].zero), None))
    return list(dict.fromkeys(wanted))


def chain_kinds(plan: Any) -> tuple[tuple[str, ...], ...]:
    """Per pipeline rank (its model chunks in order), the kind of each chained optimizer:
    "distributed" (ZeRO-1), "sharded" (ZeRO-2/3 under bf16/fp16: fp32 FSDP2 shards are the
    master weights) or "local" (megatron's FP32Optimizer / Float16OptimizerWithFloat16Params).
    Their state dicts differ in structure between kinds."""
    half = plan.precision in ("bf16", "fp16")
    kinds: list[list[str]] = [[] for _ in range(plan.pp)]
    for chunk in range(len(plan.stages)):
        kinds[chunk % plan.pp] += ["distributed" if zero == 1 else "sharded" if zero >= 2 and half
                                   else "local" for _, zero, _ in stage_class_keys(plan, chunk)]
    return tuple(tuple(k) for k in kinds)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradClass:
    """Parameters that share a gradient group and a ZeRO level."""

    tp: int
    """Tensor-parallel degree of the params (expert tp for an expert class)."""
    zero: int
    modules: tuple[torch.nn.Module, ...]
    pg_collection: ProcessGroupCollection
    expert: tuple[int, int] | None = None
    """(ep, etp) for routed experts of MoE layers, None for other params."""

    @property
    def key(self) -> tuple:
        return (self.tp, self.zero, self.expert)


def _expert_collection(pgc: ProcessGroupCollection) -> ProcessGroupCollection:
    """An MoE layer's collection seen from its experts: tp = expert tp, the data-parallel groups
    = the expert-data-parallel group (DDP reduces and the distributed optimizer shards over
    dp_cp / intra_dp_cp)."""
    fields = {k: v for k, v in vars(pgc).items() if not k.startswith("_")}
    return ProcessGroupCollection(**{**fields, "tp": pgc.expt_tp, "dp": pgc.expt_dp,
                                     "dp_cp": pgc.expt_dp, "intra_dp_cp": pgc.expt_dp})


def moe_parts(layer: torch.nn.Module) -> tuple[list[torch.nn.Module], torch.nn.Module | None]:
    """(the layer's modules other than its routed experts, the experts or None)."""
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None) if hasattr(mlp, "router") else None
    if experts is None or mlp is None:
        return [layer], None
    rest = [m for name, m in layer.named_children() if name != "mlp"]
    rest += [m for name, m in mlp.named_children() if name != "experts"]
    return rest, experts


def grad_classes(model: HeteroGPTModel) -> list[GradClass]:
    """Classes in first-use order: embedding, layers, final norm + output layer."""
    plan = model.plan
    start, end = model.decoder.builds[0].layer_idx, model.decoder.builds[-1].layer_idx + 1
    found: dict[tuple, tuple[list[torch.nn.Module], ProcessGroupCollection]] = {}

    def add(tp: int, zero: int, module: torch.nn.Module | None, pgc: ProcessGroupCollection,
            expert: tuple[int, int] | None = None) -> None:
        if module is not None and any(p.requires_grad for p in module.parameters()):
            found.setdefault((tp, zero, expert), ([], pgc))[0].append(module)

    vocab_pg = model.pg_collection
    if model.pre_process:
        add(plan.vocab.tp, vocab_zero(plan.layers[start].zero), model.embedding, vocab_pg)
    for build in model.decoder.builds:
        strategy = plan.layers[build.layer_idx]
        rest, experts = moe_parts(model.decoder.layers[str(build.layer_idx)])
        for module in rest:
            add(strategy.tp, strategy.zero, module, build.pg_collection)
        if experts is not None:
            for param in experts.parameters():
                param.allreduce = True  # reduced over the expert-DP group by their own DDP
            add(strategy.expert_tp, strategy.zero, experts,
                _expert_collection(build.pg_collection), (strategy.ep, strategy.expert_tp))
    last_zero = vocab_zero(plan.layers[end - 1].zero)
    add(plan.vocab.tp, last_zero, model.decoder.final_layernorm, model.decoder.pg_collection)
    if model.post_process:
        add(plan.vocab.tp, last_zero, model.output_layer, vocab_pg)
    add(plan.vocab.tp, vocab_zero(plan.layers[start].zero), getattr(model, "vocab", None),
        vocab_pg)
    return [GradClass(tp=tp, zero=zero, modules=tuple(mods), pg_collection=pgc, expert=expert)
            for (tp, zero, expert), (mods, pgc) in found.items()]


class HeteroDDP(_BaseDataParallel):
    """One stock DDP per gradient class, presented as a single data-parallel model chunk."""

    def __init__(self, module: HeteroGPTModel, ddp_config: DistributedDataParallelConfig) -> None:
        super().__init__(config=module.config, module=module)
        self.ddp_config = ddp_config
        self.classes = grad_classes(module)
        self._ddps = [self._wrap(cls, ddp_config) for cls in self.classes]
        # a plain list above: not submodules, so state dicts stay the model's
        shard_root(module.decoder, self.sharded)

    def _wrap(self, cls: GradClass, ddp_config: DistributedDataParallelConfig
              ) -> DistributedDataParallel | ShardedLayers:
        if cls.zero >= 2:
            return ShardedLayers(self.module.config, list(cls.modules),
                                 group=cls.pg_collection.dp_cp, zero=cls.zero)
        # --overlap-param-gather is a distributed-optimizer feature (Megatron-LM requires
        # --use-distributed-optimizer for it): a ZeRO-0 class has no parameters to gather. Keep it
        # off there; megatron-core 0.19 reads overlap_param_gather without the distributed
        # optimizer as its layer-wise optimizer's gather (distributed_data_parallel.py:306-309).
        zero1 = cls.zero >= 1
        return DistributedDataParallel(
            config=self.module.config,
            ddp_config=dataclasses.replace(
                ddp_config, use_distributed_optimizer=zero1,
                overlap_param_gather=ddp_config.overlap_param_gather and zero1),
            module=torch.nn.ModuleList(cls.modules), pg_collection=cls.pg_collection)

    @property
    def ddps(self) -> list[DistributedDataParallel | ShardedLayers]:
        return self._ddps

    @property
    def sharded(self) -> list[ShardedLayers]:
        """The ZeRO-2/3 classes."""
        return [ddp for ddp in self._ddps if isinstance(ddp, ShardedLayers)]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for ddp in self._ddps:
                stack.enter_context(ddp.no_sync())
            yield

    def start_grad_sync(self, *unused: Any) -> None:
        for ddp in self._ddps:
            ddp.start_grad_sync()

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        for ddp in self._ddps:
            ddp.finish_grad_sync(force_all_reduce=force_all_reduce)

    def start_param_sync(self, *unused: Any, force_sync: bool = False,
                         force_dispatch: bool = False) -> None:
        for ddp in self._ddps:
            ddp.start_param_sync(force_sync=force_sync, force_dispatch=force_dispatch)

    def reshard(self) -> None:
        """ZeRO-2/3 layers drop gathered weights (after a forward-only pass)."""
        for ddp in self.sharded:
            ddp.reshard()

    def scale_gradients(self, scaling_factor: float) -> None:
        for ddp in self._ddps:
            ddp.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        for ddp in self._ddps:
            ddp.zero_grad_buffer()

    def broadcast_params(self) -> None:
        for ddp in self._ddps:
            ddp.broadcast_params()

    def sharded_state_dict(self, prefix: str = "", *args: Any, **kwargs: Any) -> dict:
        """The model's sharded state dict (global layer keys), not prefixed by `module.`."""
        return self.module.sharded_state_dict(prefix, *args, **kwargs)

    def allreduce_sequence_parallel_grads(self) -> None:
        """Sum SP-tagged (and qk-layernorm) grads over each class's own tp group.

        MLA's q_layernorm normalises the whole (gathered) query latent, so without SP its grad
        is complete on every TP rank; megatron-core's name rule for per-head q/k norms
        (finalize_model_grads.py:353-355) would double it. Under SP it runs on the sequence
        shard and is SP-tagged (summed by that rule)."""
        qk = (bool(getattr(self.config, "qk_layernorm", False))
              and not getattr(self.config, "multi_latent_attention", False))
        for cls, ddp in zip(self.classes, self._ddps):
            cfg = SimpleNamespace(sequence_parallel=True, qk_layernorm=qk)
            _allreduce_non_tensor_model_parallel_grads([ddp], cfg, cls.pg_collection.tp)


def finalize_grads(
    model: list[HeteroDDP],
    num_tokens: torch.Tensor | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    force_all_reduce: bool | None = False,
) -> None:
    """`finalize_model_grads_func` for heterogeneous plans (megatron-core's, per gradient class).

    DP reduction per class; SP layernorm grads over each class's tp group; tied embedding grads
    over the first/last-stage embedding group; grads divided by the global token count.
    `num_tokens` is this rank's loss-token count, as `losses.loss_func` reports it on the last
    stage (its `[b_loc, s_loc]` tokens); it is summed over the last stage's distinct token
    blocks (its dp_cp group, as megatron-core's finalize_model_grads does) and broadcast along
    the pipeline.
    """
    for c in model:  # every model chunk of an interleaved plan has its own HeteroDDP
        c.finish_grad_sync(force_all_reduce=force_all_reduce)
    for c in model:
        c.allreduce_sequence_parallel_grads()
    inner: HeteroGPTModel = model[0].module
    if inner.groups.embd is not None:  # megatron's: model[0] on the first stage, model[-1] last
        _allreduce_word_embedding_grads(model, inner.config, inner.groups.embd, inner.groups.pp)
    if num_tokens is not None:  # this rank's loss tokens on the last stage
        total = num_tokens.detach().to(torch.float64).reshape(1)
        if inner.groups.stage == inner.plan.pp - 1:  # the last chunk holds the loss
            dist.all_reduce(total, group=model[-1].module.decoder.pg_collection.dp_cp)
        if inner.plan.pp > 1:
            last = dist.get_global_rank(inner.groups.pp, inner.plan.pp - 1)
            dist.broadcast(total, src=last, group=inner.groups.pp)
        if total.item() > 0:
            for c in model:
                c.scale_gradients(1.0 / total.item())
    if inner.config.num_moe_experts is not None:  # global_aux_loss counts, as megatron-core
        reset_model_temporary_tensors(inner.config, model)


def force_param_sync(chunks: list[torch.nn.Module]) -> None:
    """Gather every weight the last optimizer step updated, now: Megatron-LM's force_param_sync
    before a checkpoint save. Under --overlap-param-gather the distributed optimizer writes
    each rank's own shard of the weights and defers their all-gather to the next forward, so
    until then a rank holds the other ranks' shards one step old, and the data-parallel rank
    that writes a weight to the checkpoint would write those: a resumed run then starts from
    weights the uninterrupted run never had."""
    for chunk in chunks:
        for ddp in getattr(chunk, "ddps", [chunk]):
            cfg = getattr(ddp, "ddp_config", None)
            if (isinstance(ddp, DistributedDataParallel) and cfg is not None
                    and cfg.use_distributed_optimizer and cfg.overlap_param_gather):
                ddp.start_param_sync(force_sync=True)

