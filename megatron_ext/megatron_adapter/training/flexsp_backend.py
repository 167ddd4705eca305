"""Backend for plans with a `flexsp` section (`pretrain_gpt.py --flexsp`, or --strategy-config).

Legend: n = samples this rank reads per step, s = seq_length.

Every rank holds the whole model (tp = pp = cp = 1), so megatron-core's parallel state has one
data-parallel group, the world: a stock `DistributedDataParallel` (bucketed, overlap when
--overlap-grad-reduce) sums gradients over it and `get_megatron_optimizer` builds the optimizer
(ZeRO-1 with --use-distributed-optimizer). Per step:

1. each rank reads its share of the global batch (the loop's `MicroBatchIterator`, one slice of
   every global micro-batch) and cuts every sample into documents after each EOD token, the
   variable-length sequences FlexSP schedules (Megatron's reset_position_ids/attention_mask view
   of the same sample);
2. the documents' lengths are all-gathered and every rank runs the deterministic FlexSP planner
   (planner/flexsp) on the same list, so all ranks hold the same plan;
3. `flexsp_step` dispatches the tokens, runs the micro-batches on their Ulysses groups with the
   per-token loss over the global batch, and leaves the reduced gradients in DDP's buffers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.transformer.module import Float16Module

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.flexsp.model import build_flexsp_gpt, flexsp_step
from megatron_ext.megatron_adapter.losses import check_loss
from megatron_ext.megatron_adapter.training.backend import Backend, BackendName, Batch
from megatron_ext.megatron_adapter.training.data import DataShard
from megatron_ext.megatron_adapter.training.model_config import (
    ddp_config,
    optimizer_config,
    run_transformer_config,
)
from megatron_ext.megatron_adapter.training.run_config import RunConfig
from megatron_ext.megatron_adapter.transformer_config import gpt_model_kwargs
from megatron_ext.megatron_adapter.weights import init_plan_invariant
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.flexsp import FlexSPCostModel, StepPlan, plan_step
from megatron_ext.planner.flexsp.cost import cost_model_for_plan, cost_model_from_specs
from megatron_ext.presets import cluster_preset
from megatron_ext.runtime.flexsp import FlexSPGroups, check_ulysses_degree
from megatron_ext.runtime.flexsp.documents import split_documents

logger = logging.getLogger(__name__)

__all__ = ["build_flexsp_backend"]


def _cost_model(plan: ParallelPlan) -> FlexSPCostModel:
    """The plan's own cluster when it has one, else DGX-H100 nodes (Megatron flags name no
    cluster): the plan's quality depends on it, its correctness does not."""
    if plan.cluster is not None:
        return cost_model_for_plan(plan)
    assert plan.flexsp is not None
    cluster = cluster_preset("dgx-h100", num_nodes=max(1, math.ceil(plan.world_size / 8)))
    return cost_model_from_specs(plan.model, cluster, num_gpus=plan.world_size,
                                 min_degree=plan.flexsp.min_group_size,
                                 max_degree=plan.flexsp.max_group_size)


def _check(run: RunConfig, cost: FlexSPCostModel) -> None:
    """User errors, before any group beyond the world is created."""
    plan = run.plan
    dropout = run.model.attention_dropout
    if dropout != 0:  # Megatron's default is 0.1
        raise PlanError(f"--attention-dropout={dropout}: FlexSP attention has no dropout; pass "
                        "--attention-dropout 0")
    if plan.layers[0].zero > 1:
        raise PlanError(f"FlexSP runs zero<=1, got zero={plan.layers[0].zero}; drop ZeRO-3")
    check_ulysses_degree(plan.model.num_attention_heads, plan.model.num_query_groups,
                         cost.effective_max_degree)


def _step_lengths(docs: list[torch.Tensor]) -> tuple[list[int], list[int], int]:
    """All ranks' document lengths (rank-major), their loading ranks, and my first id."""
    gathered: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, [int(d.shape[0]) for d in docs])
    lengths = [n for per_rank in gathered for n in per_rank]
    owners = [r for r, per_rank in enumerate(gathered) for _ in per_rank]
    first = sum(len(g) for g in gathered[:dist.get_rank()])
    return lengths, owners, first


def _describe(plan: StepPlan, planner_ms: float) -> str:
    shapes = []
    for mb in plan.microbatches:
        counts: dict[int, int] = {}
        for g in mb.groups:
            counts[g.degree] = counts.get(g.degree, 0) + 1
        shapes.append("<" + ",".join(f"{d}x{n}" for d, n in sorted(counts.items(),
                                                                   reverse=True)) + ">")
    return (f"flexsp: {len(plan.lengths)} sequences, {plan.num_tokens} tokens, longest "
            f"{max(plan.lengths)}; {len(plan.microbatches)} micro-batches {' '.join(shapes)}; "
            f"planned in {planner_ms:.1f} ms")


def _build_ddp(run: RunConfig, config: Any, padded_vocab: int) -> DistributedDataParallel:
    kwargs = gpt_model_kwargs(run.plan.model, run.model)
    gpt: torch.nn.Module = build_flexsp_gpt(
        config, vocab_size=padded_vocab, max_sequence_length=kwargs.pop("max_sequence_length"),
        position_embedding_type=kwargs.pop("position_embedding_type"),
        tied_embeddings=kwargs.pop("share_embeddings_and_output_weights"), **kwargs)
    if run.system.init == "plan_invariant":
        init_plan_invariant(gpt, run.system.seed)
    if run.plan.precision in ("bf16", "fp16"):
        gpt = Float16Module(config, gpt)
    ddp = DistributedDataParallel(config, ddp_config(run, zero=run.plan.layers[0].zero), gpt)
    ddp.broadcast_params()
    return ddp


@dataclass(kw_only=True, eq=False)
class FlexSPBackend(Backend):
    """Whole-model ranks, per-step Ulysses groups (module docstring)."""

    name: ClassVar[BackendName] = "flexsp"

    cost: FlexSPCostModel
    """What the per-step planner minimises."""
    groups: FlexSPGroups
    """Ulysses groups of every size the planner may use."""
    eod: int
    """The tokenizer's end-of-document id: samples are cut into documents after it."""
    check_nan: bool
    """--check-for-nan-in-loss-and-grad on the step's loss."""
    log_interval: int
    """Log the step plan every this many training steps (--log-interval)."""
    steps: int = 0
    """Training steps run so far."""

    def forward_backward(self, data: Iterator[Batch] | None, num_microbatches: int | None = None,
                         forward_only: bool = False) -> float:
        assert data is not None, "every FlexSP rank reads data"
        batches = [next(data) for _ in range(num_microbatches or self.num_microbatches)]
        tokens, labels, mask = (torch.cat([b[k] for b in batches])  # [n, s] each
                                for k in ("tokens", "labels", "loss_mask"))
        docs = split_documents(tokens, labels, mask, eod=self.eod)
        lengths, owners, first = _step_lengths(docs)
        start_s = time.perf_counter()
        step_plan = plan_step(lengths, self.cost)
        planner_ms = (time.perf_counter() - start_s) * 1e3
        local = {first + i: d for i, d in enumerate(docs)}
        assert all(owners[i] == dist.get_rank() for i in local)
        loss = flexsp_step(self.model[0], step_plan, local, owners, groups=self.groups,
                           forward_only=forward_only)
        if self.check_nan:  # the step's global loss, the same on every rank
            check_loss(torch.tensor(loss, dtype=torch.float64))
        self.steps += 0 if forward_only else 1
        if dist.get_rank() == 0 and not forward_only and self.steps % self.log_interval == 0:
            logger.info(_describe(step_plan, planner_ms))
        return loss


def build_flexsp_backend(run: RunConfig, padded_vocab: int, eod: int) -> FlexSPBackend:
    """Model, optimizer and the per-step FlexSP driver for this rank; samples are cut into
    documents after each `eod` token (the tokenizer's end-of-document id)."""
    plan = run.plan
    assert plan.flexsp is not None
    cost = _cost_model(plan)
    _check(run, cost)
    parallel_state.initialize_model_parallel(  # tp = pp = cp = 1: one data-parallel group
        distributed_timeout_minutes=run.system.distributed_timeout_minutes)
    tensor_parallel.model_parallel_cuda_manual_seed(run.system.seed)
    # per-token loss: DDP sums gradients; each rank's loss is already over the global count
    config = run_transformer_config(run, plan.layers[0], calculate_per_token_loss=True)
    ddp = _build_ddp(run, config, padded_vocab)
    optimizer = get_megatron_optimizer(optimizer_config(
        run, use_distributed_optimizer=plan.layers[0].zero >= 1), [ddp])
    world = dist.get_world_size()
    return FlexSPBackend(
        model=[ddp], optimizer=optimizer, config=config,
        shard=DataShard(index=dist.get_rank(), count=world),
        rank_micro_batch_size=plan.micro_batch_size // world, needs_data=True,
        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        padded_vocab_size=padded_vocab, num_microbatches=plan.num_microbatches, cost=cost,
        groups=FlexSPGroups(max_degree=cost.effective_max_degree), eod=eod,
        check_nan=run.optimizer.check_for_nan_in_loss_and_grad,
        log_interval=run.logging.log_interval)
