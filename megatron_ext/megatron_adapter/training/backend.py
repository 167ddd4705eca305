"""What the loop needs from a model: built chunks, optimizer, data shard, and a step function.

Legend: b = samples in one rank's micro-batch, s = seq_length, v = padded vocabulary.

`Backend` is the small interface between the training loop and whoever builds the model. The
stock backend here runs every plan megatron-core can express on its own (one strategy for all
layers, Megatron's vocabulary layout, pipeline stages of any sizes): `parallel_state`, `GPTModel`,
megatron-core DDP, `get_megatron_optimizer` and `get_forward_backward_func`. Heterogeneous plans
go to the layerwise runtime (`build_backend` picks).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
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
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.sp_norm import (
    gpt_block_spec,
    have_transformer_engine,
)
from megatron_ext.megatron_adapter.training.data import DataShard
from megatron_ext.megatron_adapter.training.model_config import (
    optimizer_config,
    transformer_config,
)
from megatron_ext.megatron_adapter.training.report import reduce_loss
from megatron_ext.plan import ParallelPlan

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, eq=False)
class Backend:
    """A built model and optimizer for this rank, as the loop and checkpoints use them."""

    model: list[torch.nn.Module]
    """Model chunks of this rank (megatron-core DDP-wrapped)."""
    optimizer: Any
    """megatron-core MegatronOptimizer (or ChainedOptimizer)."""
    config: Any
    """TransformerConfig the schedule reads hooks from."""
    shard: DataShard
    """Which slice of every global micro-batch this rank reads."""
    micro_batch_size: int
    """Samples of one micro-batch on this rank."""
    needs_data: bool
    """True on the stages that read tokens or labels (first and last)."""
    dp_cp_group: Any
    """Group over which replicated state is sharded in checkpoints."""
    forward_backward: Callable[..., float]
    """(data_iterator, num_microbatches, forward_only) -> the step's global mean token loss,
    the same on every rank (gradients are left finalized in the grad buffers)."""
    padded_vocab_size: int
    """Output-layer rows; part of the checkpoint's shape contract."""
    model_format: str = "megatron"
    """Checkpoint key layout: "megatron" (stock GPTModel, Megatron-LM compatible) or
    "layerwise" (the heterogeneous runtime's per-layer keys)."""

    def sharded_state_dict(self, metadata: dict[str, Any]) -> dict[str, Any]:
        """Model state, keyed by global layer index so any plan can load it."""
        # `.module`: DDP has no sharded_state_dict override (mcore_cpu.md section 8.3).
        if len(self.model) == 1:
            return {"model": self.model[0].module.sharded_state_dict(metadata=metadata)}
        return {f"model{i}": chunk.module.sharded_state_dict(metadata=metadata)
                for i, chunk in enumerate(self.model)}

    def load_model_state(self, state: dict[str, Any]) -> None:
        if len(self.model) == 1:
            self.model[0].module.load_state_dict(state["model"], strict=True)
            return
        for i, chunk in enumerate(self.model):
            chunk.module.load_state_dict(state[f"model{i}"], strict=True)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[Any, ...]:
    """Megatron-LM pretrain_gpt's loss: (sum of masked token losses, tokens, report)."""
    losses = output_tensor.float().view(-1)  # [b*s]
    mask = loss_mask.float().view(-1)  # [b*s]
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])  # [2]
    return loss, num_tokens, {"lm loss": report}


def forward_step(cp_group: Any, data_iterator: Iterator | None, model: torch.nn.Module) -> Any:
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:  # a middle pipeline stage: activations come from the previous stage
        return model(None, None, None), partial(loss_func, None)
    if cp_group is not None and cp_group.size() > 1:
        batch = get_batch_on_this_cp_rank(batch, cp_group=cp_group)  # [b, s/cp] each
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"], loss_mask=batch["loss_mask"])  # [b, s] token losses
    return output, partial(loss_func, batch["loss_mask"])


def stock_unsupported_reason(plan: ParallelPlan) -> str | None:
    """Why stock megatron-core cannot run this plan, or None when it can."""
    s = plan.layers[0]
    if not plan.is_uniform():
        return "layers use different strategies"
    if plan.vocab.mode != "tp" or plan.vocab.tp != s.tp:
        return f"the vocabulary layout ({plan.vocab.mode}, tp={plan.vocab.tp}) differs from the layers"
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


def use_transformer_engine(args: argparse.Namespace) -> bool:
    """--transformer-impl transformer_engine (Megatron's default) when TE is importable."""
    wanted = getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine"
    if wanted and not have_transformer_engine():
        logger.warning("--transformer-impl transformer_engine: transformer-engine is not "
                       "installed, using the local (megatron-core) layers")
    return wanted and have_transformer_engine()


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
        rotary_percent=getattr(args, "rotary_percent", None) or 1.0,
        rotary_base=getattr(args, "rotary_base", None) or 10000,
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


def build_backend(args: argparse.Namespace, plan: ParallelPlan, padded_vocab: int, *,
                  model_format: str | None = None, eod: int | None = None) -> Backend:
    """The stock backend when megatron-core can express the plan, else the layerwise runtime.

    `model_format` is the format of the checkpoint to be loaded: a "layerwise" checkpoint is
    resumed by the layerwise runtime even under a uniform plan; a "megatron" one cannot be
    loaded by the runtime yet (the two key layouts differ). `eod` (the tokenizer's end-of-
    document id) is needed by FlexSP plans, which cut samples into documents.
    """
    reason = stock_unsupported_reason(plan)
    if plan.flexsp is not None:  # its checkpoints use GPTModel's keys: any format but layerwise
        from megatron_ext.megatron_adapter.training.flexsp_backend import (
            build_flexsp_backend,
        )

        if model_format == "layerwise":
            raise PlanError("--load holds a layerwise-runtime checkpoint; a FlexSP plan loads "
                            "only stock (megatron) checkpoints")
        assert eod is not None, "FlexSP plans need the tokenizer's eod id"
        return build_flexsp_backend(args, plan, padded_vocab, eod)
    if reason is None and model_format != "layerwise":
        return build_stock_backend(args, plan, padded_vocab)
    if reason is not None and model_format == "megatron":
        raise PlanError(f"--load holds a checkpoint of a uniform (stock megatron-core) plan, "
                        f"but this plan needs the layerwise runtime ({reason}), whose checkpoint "
                        "layout differs; start from a uniform plan, or convert is not supported "
                        "yet")
    reason = reason or "the checkpoint was written by the layerwise runtime"
    try:
        from megatron_ext.megatron_adapter.training.runtime_backend import (
            build_runtime_backend,
        )
    except ModuleNotFoundError as err:  # a partial install without the layerwise runtime
        raise PlanError(f"this plan needs the layerwise runtime ({reason}): {err}") from None
    return build_runtime_backend(args, plan, padded_vocab)
