"""The stock backend: plans megatron-core expresses on its own (one strategy for all layers,
Megatron's vocabulary layout, pipeline stages of any sizes) on `parallel_state`, `GPTModel`,
megatron-core DDP, `get_megatron_optimizer` and `get_forward_backward_func`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from functools import partial
from typing import Any

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.pipeline_parallel_layer_layout import (
    PipelineParallelLayerLayout,
)

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.layers import rope_kwargs
from megatron_ext.megatron_adapter.sp_norm import gpt_block_spec
from megatron_ext.megatron_adapter.training.backend import (
    Backend,
    forward_step,
    use_transformer_engine,
)
from megatron_ext.megatron_adapter.training.data import DataShard
from megatron_ext.megatron_adapter.training.model_config import (
    optimizer_config,
    transformer_config,
)
from megatron_ext.megatron_adapter.training.report import reduce_loss
from megatron_ext.plan import ParallelPlan


def stock_unsupported_reason(plan: ParallelPlan) -> str | None:
    """Why stock megatron-core cannot run this plan, or None when it can."""
    s = plan.layers[0]
    if not plan.is_uniform():
        return "layers use different strategies"
    if plan.vocab.mode != "tp" or plan.vocab.tp != s.tp:
        return (f"the vocabulary layout ({plan.vocab.mode}, tp={plan.vocab.tp}) differs from "
                "the layers")
    if plan.flexsp is not None:
        return "flexible sequence parallelism is on"
    if s.ulysses > 1:
        return "Ulysses sequence parallelism is used"
    if s.zero == 3:
        return "ZeRO-3 is used"
    return None


def _layout(plan: ParallelPlan) -> PipelineParallelLayerLayout | None:
    sizes = [end - start for start, end in plan.stages]
    if plan.pp == 1 or len(set(sizes)) == 1:
        return None
    text = "E" + "|".join("t" * n for n in sizes) + "L"  # e.g. "Ettt|tL" for stages 3+1
    return PipelineParallelLayerLayout(text, plan.pp)


def _build_gpt(args: argparse.Namespace, plan: ParallelPlan, config: Any, vocab: int) -> Any:
    model = plan.model
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=gpt_block_spec(
            config, use_transformer_engine=use_transformer_engine(args)),
        vocab_size=vocab,
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=model.tied_embeddings,
        position_embedding_type=model.position_embedding,
        **rope_kwargs(model),
    )
    if plan.precision in ("bf16", "fp16"):
        gpt = Float16Module(config, gpt)
    return gpt


def build_stock_backend(args: argparse.Namespace, plan: ParallelPlan, padded_vocab: int) -> Backend:
    """Initialise megatron-core's parallel state for a uniform plan and build everything."""
    reason = stock_unsupported_reason(plan)
    assert reason is None, reason
    s = plan.layers[0]
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=plan.pp,
        context_parallel_size=s.cp, distributed_timeout_minutes=getattr(
            args, "distributed_timeout_minutes", None) or 10,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)  # through the module: cpu_compat
    config = transformer_config(args, plan, s, pipeline_model_parallel_layout=_layout(plan))
    gpt = _build_gpt(args, plan, config, padded_vocab)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False)),
        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
        overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
        use_distributed_optimizer=s.zero >= 1,
        check_for_nan_in_grad=bool(getattr(args, "check_for_nan_in_loss_and_grad", False)),
    )
    ddp = DistributedDataParallel(config, ddp_config, gpt)
    ddp.broadcast_params()  # replicas start equal even if init streams differ
    optimizer = get_megatron_optimizer(optimizer_config(
        args, plan, use_distributed_optimizer=s.zero >= 1), [ddp])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if ddp_config.overlap_grad_reduce:
        config.no_sync_func = ddp.no_sync
    if ddp_config.overlap_param_gather:
        config.param_sync_func = ddp.start_param_sync
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    dp = parallel_state.get_data_parallel_world_size()
    if plan.micro_batch_size % dp:
        raise PlanError(f"micro_batch_size={plan.micro_batch_size} does not split over dp={dp}")
    mbs = plan.micro_batch_size // dp
    step = partial(forward_step, parallel_state.get_context_parallel_group())
    schedule = get_forward_backward_func()

    reports_loss = last and parallel_state.get_tensor_model_parallel_rank() == 0

    def forward_backward(data_iterator: Iterator | None, num_microbatches: int,
                         forward_only: bool) -> float:
        reports = schedule(
            forward_step_func=step, data_iterator=data_iterator, model=[ddp],
            num_microbatches=num_microbatches, seq_length=plan.seq_length,
            micro_batch_size=mbs, forward_only=forward_only,
        )
        return reduce_loss(reports, reports_loss)

    return Backend(
        model=[ddp], optimizer=optimizer, config=config,
        shard=DataShard(index=parallel_state.get_data_parallel_rank(), count=dp),
        micro_batch_size=mbs, needs_data=first or last,
        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        forward_backward=forward_backward, padded_vocab_size=padded_vocab,
    )
