"""Backend for plans stock megatron-core cannot express: the layerwise heterogeneous runtime.

`build_model(plan, config)` builds this rank's stage with per-layer strategies, `build_optimizer`
one megatron-core optimizer per gradient class, and `forward_backward` drives megatron-core's
schedules with the plan's stage shapes and losses.forward_step. Each rank reads only the rows of
every micro-batch its stage's token layouts give it (`data_shard`); the model slices its part.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch.distributed as dist

from megatron_ext.geometry.vocab import vocab_parallel_layout
from megatron_ext.megatron_adapter.build import build_model
from megatron_ext.megatron_adapter.model import HeteroGPTModel
from megatron_ext.megatron_adapter.moe_logging import clear_router_losses, router_losses
from megatron_ext.megatron_adapter.optimizer import build_optimizer
from megatron_ext.megatron_adapter.train_step import forward_backward
from megatron_ext.megatron_adapter.training.backend import Backend
from megatron_ext.megatron_adapter.training.data import DataShard
from megatron_ext.megatron_adapter.training.model_config import (
    ddp_config,
    optimizer_config,
    run_transformer_config,
)
from megatron_ext.megatron_adapter.training.run_config import RunConfig


def data_shard(model: HeteroGPTModel) -> DataShard | None:
    """The rows of each micro-batch this rank reads, or None when its stage reads no tokens.

    The layouts whose tokens the stage takes (embedding input on the first stage, loss on the
    last; the vocabulary layout on every stage under vocabulary parallelism) cut the batch into
    dp_l contiguous blocks, data-parallel rank outermost (runtime/layout.py); the blocks of
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


def build_runtime_backend(run: RunConfig, padded_vocab: int) -> Backend:
    # The model is built with exactly `padded_vocab` rows (the caller checked it splits over
    # the vocabulary shards), so checkpoints keep one vocabulary shape across plans.
    plan = run.plan
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, vocab_size=padded_vocab))
    config = run_transformer_config(run, plan.layers[0])
    # zero per gradient class is set by HeteroDDP; overlap_param_gather acts on the ZeRO-1 ones
    chunks, groups = build_model(plan, config, ddp_config=ddp_config(run, zero=0),
                                 seed=run.system.seed, use_te=run.model.use_transformer_engine,
                                 make_vocab_size_divisible_by=1, model_options=run.model)
    optimizer = build_optimizer(chunks, optimizer_config(run, use_distributed_optimizer=False))
    chunks[0].module.config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's setup
    # the chunk that reads tokens or labels (interleaved plans: at most one per rank)
    inner: HeteroGPTModel = next((c.module for c in chunks
                                  if c.module.pre_process or c.module.post_process),
                                 chunks[0].module)
    shard = data_shard(inner)
    if shard is not None:
        for chunk in chunks:
            chunk.module.batch_shard = (shard.index, shard.count)
    check_nan = run.optimizer.check_for_nan_in_loss_and_grad
    metrics: dict[str, float] = {}

    def step(data: Iterator | None, num_microbatches: int, forward_only: bool) -> float:
        clear_router_losses()
        loss = forward_backward(chunks, data, groups, forward_only=forward_only,
                                check_nan=check_nan, num_microbatches=num_microbatches)["loss"]
        if not forward_only:
            metrics.clear()
            metrics.update(router_losses(plan, num_microbatches))
        return loss

    return Backend(step_metrics=metrics,
        model=list(chunks), optimizer=optimizer, config=chunks[0].module.config,
        shard=shard or DataShard(index=0, count=1),
        rank_micro_batch_size=plan.micro_batch_size // (shard.count if shard else 1),
        needs_data=shard is not None, dp_cp_group=dist.group.WORLD, name="layerwise",
        forward_backward=step, padded_vocab_size=padded_vocab, model_format="layerwise",
    )
