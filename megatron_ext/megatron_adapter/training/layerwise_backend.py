"""The layerwise heterogeneous runtime as a backend: plans stock megatron-core cannot express.

Legend: s = sequence, b = micro-batch (all replicas), h = hidden.

`build_model(plan, config)` builds this rank's stage with per-layer strategies, `build_optimizer`
one megatron-core optimizer per gradient class, and `LayerwiseBackend.forward_backward` drives
megatron-core's own schedules:

- pp = 1 runs `forward_backward_no_pipelining`; pp > 1 runs megatron-core's 1F1B
  (`forward_backward_pipelining_without_interleaving`) with this plan's `P2PCommunicator` and an
  `adjust_tensor_shapes_fn`: stage p receives `[s_loc, b_loc, h]` of the layout stage p-1 sends
  (its last layer's) and sends its own last layer's layout, so uneven stages and different
  strategies on both sides of a boundary pass fixed, known shapes (no shape exchange).
- Interleaved plans (virtual_stages > 1) run `forward_backward_pipelining_with_interleaving`
  over the rank's model chunks. That schedule passes one tensor shape for every message (no
  adjust_tensor_shapes_fn), so every chunk boundary carries one layout
  (geometry.stages.chunk_boundary_layout) and `ChunkP2P` sends and receives its
  `[s_loc, b_loc, h]`. The chunk reading tokens (chunk 0 on the first stage) or labels (the
  last chunk on the last stage) gets the data iterator; the others get None.

Each rank reads only the rows of every micro-batch its stage's token layouts give it
(`data_shard`); batches are dicts of `[b_rank, s]` tensors (tokens, labels, loss_mask, optional
position_ids) and the model slices its part.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

from megatron_ext.geometry.stages import chunk_shape, stage_shapes
from megatron_ext.geometry.vocab import vocab_parallel_layout
from megatron_ext.megatron_adapter.build import build_model
from megatron_ext.megatron_adapter.ddp import HeteroDDP
from megatron_ext.megatron_adapter.losses import forward_step, global_loss, layerwise_view
from megatron_ext.megatron_adapter.model import HeteroGPTModel
from megatron_ext.megatron_adapter.moe_logging import clear_router_losses, router_losses
from megatron_ext.megatron_adapter.optimizer import build_optimizer
from megatron_ext.megatron_adapter.training.backend import (
    Backend,
    BackendName,
    Batch,
    ChainFormat,
)
from megatron_ext.megatron_adapter.training.data import DataShard
from megatron_ext.megatron_adapter.training.model_config import (
    ddp_config,
    optimizer_config,
    run_transformer_config,
)
from megatron_ext.megatron_adapter.training.run_config import RunConfig
from megatron_ext.plan import ParallelPlan
from megatron_ext.runtime.groups import PlanGroups

__all__ = ["ChunkP2P", "LayerwiseBackend", "build_layerwise_model", "data_shard"]


class ChunkP2P(P2PCommunicator):
    """megatron-core's P2PCommunicator with every message of `shape` (the interleaved
    schedule's own shape assumes one uniform layout and the global micro-batch)."""

    def __init__(self, *, pp_group: Any, config: Any, shape: tuple[int, int, int]) -> None:
        super().__init__(pp_group=pp_group, config=config)
        self.shape = shape

    def _communicate(self, *, tensor_shape: Any, **kwargs: Any) -> Any:  # noqa: ARG002
        return super()._communicate(tensor_shape=self.shape, **kwargs)


def data_shard(model: HeteroGPTModel) -> DataShard | None:
    """The rows of each micro-batch this rank reads, or None when its stage reads no tokens.

    The layouts whose tokens the stage takes (embedding input on the first stage, loss on the
    last; the vocabulary layout on every stage under vocabulary parallelism) cut the batch into
    dp_l contiguous blocks, data-parallel rank outermost (geometry/activation.py); the blocks of
    g = gcd(dp_l) nest them all, so the rank reads block local_rank * g // stage_width."""
    plan, groups = model.plan, model.groups
    if plan.vocab.mode == "vocab_parallel":
        layouts = [vocab_parallel_layout(plan)]
    else:
        layouts = ([model.decoder.input_layout] if model.pre_process else []) + (
            [model.decoder.output_layout] if model.post_process else [])
    if not layouts:
        return None
    count = math.gcd(*(layout.dp for layout in layouts))
    return DataShard(index=groups.local_rank * count // plan.stage_width, count=count)


@dataclass(kw_only=True, eq=False)
class LayerwiseBackend(Backend):
    """Per-layer strategies on megatron-core's schedules (module docstring)."""

    name: ClassVar[BackendName] = "layerwise"
    chain_format: ClassVar[ChainFormat] = "layerwise"

    groups: PlanGroups
    """This rank's process groups of the plan."""
    check_nan: bool = False
    """--check-for-nan-in-loss-and-grad on each micro-batch's loss."""
    forward_step_func: Callable[..., Any] | None = None
    """megatron `forward_step_func` to run instead of the runtime's (benchmarks' probes)."""

    @classmethod
    def from_model(cls, chunks: list[HeteroDDP], groups: PlanGroups, optimizer: Any, *,
                   check_nan: bool = False, forward_step_func: Callable[..., Any] | None = None,
                   **fields: Any) -> LayerwiseBackend:
        """The backend of chunks `build_model` built and `build_optimizer`'s optimizer; sets
        each chunk's batch shard (the rows of a micro-batch this rank reads). `fields`: a
        subclass's own fields."""
        plan = groups.plan
        # the chunk that reads tokens or labels (interleaved plans: at most one per rank)
        inner: HeteroGPTModel = next((c.module for c in chunks
                                      if c.module.pre_process or c.module.post_process),
                                     chunks[0].module)
        shard = data_shard(inner)
        if shard is not None:
            for chunk in chunks:
                chunk.module.batch_shard = (shard.index, shard.count)
        return cls(
            model=list(chunks), optimizer=optimizer, config=chunks[0].module.config,
            shard=shard or DataShard(index=0, count=1),
            rank_micro_batch_size=plan.micro_batch_size // (shard.count if shard else 1),
            needs_data=shard is not None, dp_cp_group=dist.group.WORLD,
            padded_vocab_size=chunks[0].module.vocab_size,
            num_microbatches=plan.num_microbatches, groups=groups, check_nan=check_nan,
            forward_step_func=forward_step_func, **fields)

    @property
    def plan(self) -> ParallelPlan:
        return self.groups.plan

    def forward_backward(self, data: Iterator[Batch] | None, num_microbatches: int | None = None,
                         forward_only: bool = False) -> float:
        clear_router_losses()
        num_microbatches = num_microbatches or self.num_microbatches
        reports = self._schedule(data, num_microbatches, forward_only)
        if forward_only:
            for chunk in self.model:
                getattr(chunk, "reshard", lambda: None)()  # ZeRO-2 weights gathered for forward
        else:
            self.step_metrics.clear()
            self.step_metrics.update(router_losses(self.plan, num_microbatches))
        return global_loss(self.model[-1].module, self.groups, reports)["loss"]

    def _schedule(self, data: Iterator[Batch] | None, num_microbatches: int,
                  forward_only: bool) -> list[dict]:
        """megatron-core's schedule for this plan (module docstring): the loss reports."""
        plan, groups, chunks = self.plan, self.groups, self.model
        inner: HeteroGPTModel = chunks[0].module
        config = inner.config
        kwargs: dict[str, Any] = {}
        data_iterator: Any = data
        if plan.virtual_stages > 1:
            kwargs["p2p_communicator"] = ChunkP2P(pp_group=groups.pp, config=config,
                                                  shape=chunk_shape(plan, config.hidden_size))
            reads = [c.module.pre_process or c.module.post_process for c in chunks]
            data_iterator = [data if r else None for r in reads]
        elif plan.pp > 1:
            recv, send = stage_shapes(plan, groups.stage, config.hidden_size)
            kwargs["adjust_tensor_shapes_fn"] = lambda _r, _s: (recv, send)
            kwargs["p2p_communicator"] = P2PCommunicator(pp_group=groups.pp, config=config)
        vp_size = plan.virtual_stages if plan.virtual_stages > 1 else None
        step = self.forward_step_func or partial(forward_step, layerwise_view, self.check_nan)
        return get_forward_backward_func(pp_size=plan.pp, vp_size=vp_size)(
            forward_step_func=step, data_iterator=data_iterator, model=chunks,
            num_microbatches=num_microbatches, seq_length=plan.seq_length,
            micro_batch_size=plan.micro_batch_size, forward_only=forward_only,
            pg_collection=inner.pg_collection, **kwargs)


def build_layerwise_model(run: RunConfig, padded_vocab: int
                          ) -> tuple[list[HeteroDDP], PlanGroups, Any]:
    """This rank's chunks, groups and chained optimizer of `run.plan` on the layerwise runtime.
    The model is built with exactly `padded_vocab` rows (the caller checked it splits over the
    vocabulary shards), so checkpoints keep one vocabulary shape across plans."""
    plan = run.plan
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, vocab_size=padded_vocab))
    config = run_transformer_config(run, plan.layers[0])
    # zero per gradient class is set by HeteroDDP; overlap_param_gather acts on the ZeRO-1 ones
    chunks, groups = build_model(plan, config, ddp_config=ddp_config(run, zero=0),
                                 seed=run.system.seed, init=run.system.init,
                                 use_te=run.model.use_transformer_engine,
                                 make_vocab_size_divisible_by=1, model_options=run.model)
    optimizer = build_optimizer(chunks, optimizer_config(run, use_distributed_optimizer=False))
    chunks[0].module.config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's setup
    return chunks, groups, optimizer
