"""Backend for plans stock megatron-core cannot express: the layerwise heterogeneous runtime.

`build_model(plan, config)` builds this rank's stage with per-layer strategies, `build_optimizer`
one megatron-core optimizer per gradient class, and `forward_backward` drives megatron-core's
schedules with the plan's stage shapes. Every rank of a stage reads the whole micro-batch
(`DataShard(0, 1)`); the model slices its part per layer layout.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator

import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallelConfig

from megatron_ext.megatron_adapter.build import build_model
from megatron_ext.megatron_adapter.optimizer import build_optimizer
from megatron_ext.megatron_adapter.train_step import forward_backward
from megatron_ext.megatron_adapter.training.backend import (
    Backend,
    use_transformer_engine,
)
from megatron_ext.megatron_adapter.training.data import DataShard
from megatron_ext.megatron_adapter.training.model_config import (
    optimizer_config,
    transformer_config,
)
from megatron_ext.plan import ParallelPlan


def build_runtime_backend(args: argparse.Namespace, plan: ParallelPlan,
                          padded_vocab: int) -> Backend:
    # The model is built with exactly `padded_vocab` rows (the caller checked it splits over
    # the vocabulary shards), so checkpoints keep one vocabulary shape across plans.
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, vocab_size=padded_vocab))
    config = transformer_config(args, plan, plan.layers[0])
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False)),
        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
    )
    chunks, groups = build_model(plan, config, ddp_config=ddp_config, seed=args.seed,
                                 use_te=use_transformer_engine(args),
                                 make_vocab_size_divisible_by=1)
    optimizer = build_optimizer(chunks, optimizer_config(args, plan,
                                                         use_distributed_optimizer=False))

    def step(data: Iterator | None, num_microbatches: int, forward_only: bool) -> float:
        assert num_microbatches == plan.num_microbatches, (num_microbatches, plan)
        return forward_backward(chunks, data, groups, forward_only=forward_only)["loss"]

    return Backend(
        model=list(chunks), optimizer=optimizer, config=chunks[0].module.config,
        shard=DataShard(index=0, count=1), micro_batch_size=plan.micro_batch_size,
        needs_data=True, dp_cp_group=dist.group.WORLD,
        forward_backward=step, padded_vocab_size=padded_vocab, model_format="layerwise",
    )
