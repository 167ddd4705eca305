"""The stock backend: plans megatron-core expresses on its own (one strategy for all layers,
Megatron's vocabulary layout, pipeline stages of any sizes) on `parallel_state`, `GPTModel`,
megatron-core DDP, `get_megatron_optimizer` and `get_forward_backward_func`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.pipeline_parallel_layer_layout import (
    PipelineParallelLayerLayout,
)

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.losses import forward_step, stock_view
from megatron_ext.megatron_adapter.mla_attention import layer_group_mla_block
from megatron_ext.megatron_adapter.sp_norm import gpt_block_spec
from megatron_ext.megatron_adapter.training.backend import Backend, BackendName, Batch
from megatron_ext.megatron_adapter.training.data import DataShard
from megatron_ext.megatron_adapter.training.model_config import (
    ddp_config,
    optimizer_config,
    run_transformer_config,
)
from megatron_ext.megatron_adapter.training.report import reduce_loss
from megatron_ext.megatron_adapter.training.run_config import InitMethod, RunConfig
from megatron_ext.megatron_adapter.transformer_config import ModelOptions, gpt_model_kwargs
from megatron_ext.megatron_adapter.weights import init_plan_invariant
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
    if s.zero >= 2:  # megatron-core's DDP keeps full gradient buffers: ZeRO-1 at most
        return f"ZeRO-{s.zero} is used"
    if plan.virtual_stages > 1:
        return "the pipeline is interleaved (virtual stages)"
    if plan.model.moe is not None:
        return "the model has Mixture-of-Experts layers"
    return None


def _layout(plan: ParallelPlan) -> PipelineParallelLayerLayout | None:
    sizes = [end - start for start, end in plan.stages]
    if plan.pp == 1 or len(set(sizes)) == 1:
        return None
    text = "E" + "|".join("t" * n for n in sizes) + "L"  # e.g. "Ettt|tL" for stages 3+1
    return PipelineParallelLayerLayout(text, plan.pp)


def _build_gpt(plan: ParallelPlan, options: ModelOptions, config: Any, vocab: int, *,
               init: InitMethod, seed: int, layer_offset: int) -> Any:
    """This stage's GPTModel (Float16Module-wrapped in half precision); `init`: as
    SystemConfig.init, the global index of the stage's first layer being `layer_offset`."""
    block = gpt_block_spec(config, use_transformer_engine=options.use_transformer_engine)
    if config.multi_latent_attention and not options.use_transformer_engine:
        # 0.19 refuses the local MLA spec's q norm without q_lora_rank and has no local fused
        # norm+linear for the query; the layerwise runtime's MLA layer brings both
        block = layer_group_mla_block(block)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=vocab,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        **gpt_model_kwargs(plan.model, options),
    )
    if init == "plan_invariant":
        init_plan_invariant(gpt, seed, layer_offset=layer_offset)
    if plan.precision in ("bf16", "fp16"):
        gpt = Float16Module(config, gpt)
    return gpt


@dataclass(kw_only=True, eq=False)
class StockBackend(Backend):
    """megatron-core's own model, DDP, optimizer and schedule (module docstring)."""

    name: ClassVar[BackendName] = "stock"

    step: Callable[..., Any]
    """megatron `forward_step_func` of this run."""
    seq_length: int
    """Tokens per sample."""
    reports_loss: bool
    """True on the ranks whose loss reports count (last stage, tensor-parallel rank 0)."""

    def forward_backward(self, data: Iterator[Batch] | None, num_microbatches: int | None = None,
                         forward_only: bool = False) -> float:
        reports = get_forward_backward_func()(
            forward_step_func=self.step, data_iterator=data, model=self.model,
            num_microbatches=num_microbatches or self.num_microbatches,
            seq_length=self.seq_length, micro_batch_size=self.rank_micro_batch_size,
            forward_only=forward_only)
        return reduce_loss(reports, self.reports_loss)


def build_stock_backend(run: RunConfig, padded_vocab: int) -> StockBackend:
    """Initialise megatron-core's parallel state for a uniform plan and build everything."""
    plan = run.plan
    reason = stock_unsupported_reason(plan)
    assert reason is None, reason
    s = plan.layers[0]
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=plan.pp,
        context_parallel_size=s.cp,
        distributed_timeout_minutes=run.system.distributed_timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(run.system.seed)  # via the module: cpu compat
    dp = parallel_state.get_data_parallel_world_size()
    if plan.micro_batch_size % dp:
        raise PlanError(f"micro_batch_size={plan.micro_batch_size} does not split over dp={dp}")
    config = run_transformer_config(
        run, s, pipeline_model_parallel_layout=_layout(plan),
        calculate_per_token_loss=run.optimizer.calculate_per_token_loss)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    gpt = _build_gpt(plan, run.model, config, padded_vocab, init=run.system.init,
                     seed=run.system.seed, layer_offset=plan.stages[stage][0])
    ddp = DistributedDataParallel(config, ddp_config(run, zero=s.zero), gpt)
    ddp.broadcast_params()  # replicas start equal even if init streams differ
    optimizer = get_megatron_optimizer(optimizer_config(
        run, use_distributed_optimizer=s.zero >= 1), [ddp])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if ddp.ddp_config.overlap_grad_reduce:
        config.no_sync_func = ddp.no_sync
    if ddp.ddp_config.overlap_param_gather:
        config.param_sync_func = ddp.start_param_sync
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    step = partial(forward_step, partial(stock_view, parallel_state.get_context_parallel_group()),
                   run.optimizer.check_for_nan_in_loss_and_grad)
    return StockBackend(
        model=[ddp], optimizer=optimizer, config=config,
        shard=DataShard(index=parallel_state.get_data_parallel_rank(), count=dp),
        rank_micro_batch_size=plan.micro_batch_size // dp, needs_data=first or last,
        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        padded_vocab_size=padded_vocab, num_microbatches=plan.num_microbatches, step=step,
        seq_length=plan.seq_length,
        reports_loss=last and parallel_state.get_tensor_model_parallel_rank() == 0)
