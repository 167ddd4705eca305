"""Entry point: `build_model(plan, config) -> (model chunks, groups)` for any valid plan.

Order: validate (plan vs runtime, plan vs world size, config vs plan: one-line PlanErrors before
any group exists) -> groups -> per-layer configs/specs -> `HeteroGPTModel` for this rank's
stage -> plan-invariant init -> `HeteroDDP`. The model config gets `calculate_per_token_loss`,
`no_sync_func` and `finalize_model_grads_func`, so megatron-core schedules drive it unchanged.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.errors import PlanError
from megatron_ext.geometry.activation import ActivationLayout
from megatron_ext.geometry.stages import (
    boundary_layout,
    chunk_boundary_layout,
    embedding_layout,
    output_layout,
)
from megatron_ext.geometry.vocab import vocab_parallel_layout, vocab_stage_roots
from megatron_ext.geometry.vocab_partition import padded_vocab_size
from megatron_ext.megatron_adapter.block import LayerBuild
from megatron_ext.megatron_adapter.cpu import compat as cpu_compat
from megatron_ext.megatron_adapter.ddp import HeteroDDP, finalize_grads
from megatron_ext.megatron_adapter.layers import (
    check_config,
    final_norm_spec,
    layer_config,
    layer_spec,
    vocab_config,
)
from megatron_ext.megatron_adapter.mla_support import check_mla_support
from megatron_ext.megatron_adapter.model import HeteroGPTModel
from megatron_ext.megatron_adapter.pg import layout_pg_collection, moe_pg_collection
from megatron_ext.megatron_adapter.transformer_config import (
    ModelOptions,
    gpt_model_kwargs,
    transformer_config,
)
from megatron_ext.megatron_adapter.vocab.layers import (
    VocabParallelLayers,
    init_vocab_plan_invariant,
)
from megatron_ext.megatron_adapter.weights import init_plan_invariant
from megatron_ext.plan import ParallelPlan
from megatron_ext.runtime.groups import (
    PlanGroups,
    build_plan_groups,
    check_world_size,
)
from megatron_ext.runtime.vocab.comm import VocabCommGroups, new_vocab_comm_groups, vocab_rank_lists
from megatron_ext.specs import ModelSpec

__all__ = ["build_model", "check_runtime_support", "prepare_megatron"]


def prepare_megatron() -> None:
    """Process-wide megatron-core setup without `initialize_model_parallel` (idempotent): the
    CPU/gloo patches (no-op with CUDA) and the global memory buffer attention uses."""
    cpu_compat.apply()
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def check_runtime_support(plan: ParallelPlan, *, embedding: bool, output_layer: bool) -> None:
    """One-line PlanError for plan features this runtime does not run."""
    if plan.flexsp is not None:
        raise PlanError("plan.flexsp is set: FlexSP plans run on the FlexSP runtime, not "
                        "build_model; remove flexsp or use the FlexSP trainer")
    if plan.vocab.mode == "vocab_parallel" and embedding != output_layer:
        raise PlanError(f"vocab.mode='vocab_parallel' with embedding={embedding}, output_layer="
                        f"{output_layer}: the vocabulary shards hold both; pass both or neither")
    if plan.vocab.mode == "vocab_parallel":
        vocab_parallel_layout(plan)  # its PlanError before any group exists
    if plan.model.moe is not None:
        check_moe_support(plan)
    check_mla_support(plan)


def check_moe_support(plan: ParallelPlan, config: TransformerConfig | None = None) -> None:
    """One-line PlanError for MoE settings the layerwise runtime does not run."""
    for idx, strategy in enumerate(plan.layers):
        if plan.model.is_moe_layer(idx) and strategy.zero >= 2:
            raise PlanError(f"layers[{idx}] is an MoE layer with zero={strategy.zero}: ZeRO-2/3 "
                            "shard whole layers and the experts reduce over their own group; "
                            "use zero 0 or 1 on MoE layers")
    if plan.model.moe is not None and plan.model.moe.router_enable_expert_bias:
        raise PlanError("model.moe.router_enable_expert_bias (--moe-router-enable-expert-bias) is "
                        "not supported by the layerwise runtime (megatron-core updates the bias "
                        "over its global groups); use --moe-aux-loss-coeff balancing")
    if plan.vocab.mode == "vocab_parallel":
        raise PlanError("vocab.mode='vocab_parallel' with model.moe: the vocabulary passes' "
                        "schedule does not scale the router's load-balancing loss; use "
                        "vocab.mode='tp'")
    if config is None:
        return
    if config.moe_grouped_gemm and not _have_grouped_gemm():
        raise PlanError("--moe-grouped-gemm needs Transformer Engine or the grouped_gemm package "
                        "(CUDA kernels), neither is available here; drop the flag: the experts "
                        "run as megatron-core's SequentialMLP")
    if config.moe_token_dispatcher_type not in ("allgather", "alltoall"):
        raise PlanError(f"--moe-token-dispatcher-type {config.moe_token_dispatcher_type} needs "
                        "DeepEP / HybridEP CUDA kernels; use allgather or alltoall")


def _have_grouped_gemm() -> bool:
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return False
    return any(importlib.util.find_spec(m) is not None
               for m in ("transformer_engine", "grouped_gemm"))


def _resolve_config(plan: ParallelPlan, config: TransformerConfig | ModelSpec | None
                    ) -> TransformerConfig:
    if config is None or isinstance(config, ModelSpec):
        if config is not None and config != plan.model:
            raise PlanError(f"model {config.name!r} differs from the plan's model "
                            f"{plan.model.name!r}; use the plan's model or re-plan")
        config = transformer_config(plan.model, precision=plan.precision)
    else:
        check_config(plan, config)
    return dataclasses.replace(config, calculate_per_token_loss=True)


def _without_cp(pgc: ProcessGroupCollection, singleton: dist.ProcessGroup
                ) -> ProcessGroupCollection:
    """Same groups, cp = singleton: the GPTModel-level rotary table covers the full sequence."""
    fields = {k: v for k, v in vars(pgc).items() if not k.startswith("_")}
    return ProcessGroupCollection(**{**fields, "cp": singleton})


def _vocab_positions(plan: ParallelPlan, groups: PlanGroups) -> int:
    """Rows of the first stage's learned absolute position embeddings (0: none here)."""
    learned = plan.model.position_embedding == "learned_absolute"
    return plan.model.max_position_embeddings if learned and groups.stage == 0 else 0


def new_plan_vocab_groups(plan: ParallelPlan) -> VocabCommGroups:
    """The vocabulary groups of every replica (collective over the world)."""
    width = plan.stage_width
    stage_ranks = [list(range(s * width, (s + 1) * width)) for s in range(plan.pp)]
    first_root, last_root = vocab_stage_roots(plan)
    return new_vocab_comm_groups(vocab_rank_lists(stage_ranks, plan.vocab.tp),
                                 last_stage_root=last_root, first_stage_root=first_root)


def _stage_model(plan: ParallelPlan, config: TransformerConfig, groups: PlanGroups, *,
                 embedding: bool, output: bool, final_norm: bool, use_te: bool | None,
                 divisible_by: int, options: ModelOptions | None,
                 vp_stage: int | None = None) -> HeteroGPTModel:
    """This rank's stage, or with `vp_stage` its model chunk vp_stage (interleaved plans:
    plan.stages[vp_stage * pp + stage], whose boundaries carry chunk_boundary_layout)."""
    stage, pp = groups.stage, plan.pp
    chunk = stage if vp_stage is None else vp_stage * pp + stage
    start, end = plan.stages[chunk]
    first, last = chunk == 0, chunk == len(plan.stages) - 1
    pgs = {layout: layout_pg_collection(groups, layout) for layout in groups.layouts}
    builds = []
    for idx in range(start, end):
        strategy = plan.layers[idx]
        layout = ActivationLayout.of(strategy)
        cfg = layer_config(config, strategy)
        moe = plan.model.is_moe_layer(idx)
        spec = layer_spec(cfg, strategy, groups.for_layout(layout).ulysses, use_te=use_te, moe=moe)
        pgc = (moe_pg_collection(groups, layout, strategy.ep, strategy.expert_tp) if moe
               else pgs[layout])
        builds.append(LayerBuild(layer_idx=idx, layout=layout, config=cfg, spec=spec,
                                 pg_collection=pgc,
                                 full_recompute=strategy.recompute == "full"))
    if vp_stage is None:
        input_layout = embedding_layout(plan) if first else boundary_layout(plan, stage - 1)
        out_layout = output_layout(plan) if last else boundary_layout(plan, stage)
    else:
        input_layout = embedding_layout(plan) if first else chunk_boundary_layout(plan)
        out_layout = output_layout(plan) if last else chunk_boundary_layout(plan)
    model_layout = (embedding_layout(plan) if first else
                    output_layout(plan) if last else ActivationLayout.of(plan.layers[start]))
    if plan.vocab.mode == "vocab_parallel":  # body only, from / to the vocabulary passes' layout
        model_layout = vocab_parallel_layout(plan)
        input_layout = model_layout if first else input_layout
        out_layout = model_layout if last else out_layout
        embedding = output = False
    model_config = vocab_config(config, model_layout, pp)
    if vp_stage is not None:  # megatron-core's interleaved schedule and LanguageModule read them
        # Unbatched, waited point-to-point: batched at pp=2 pairs sends and receives with the
        # wrong peer op (Megatron-LM forbids it) and the overlapped (async) path gave wrong
        # gradients on gloo (a sent output freed before its send completes).
        model_config = dataclasses.replace(
            model_config, virtual_pipeline_model_parallel_size=plan.virtual_stages,
            microbatch_group_size_per_vp_stage=pp, overlap_p2p_comm=False, batch_p2p_comm=False)
    assert not last or out_layout.sp == model_layout.sp, "a stage's vocabulary layouts share sp"
    return HeteroGPTModel(
        model_config, plan=plan, groups=groups, builds=builds, input_layout=input_layout,
        output_layout=out_layout,
        vocab_size=padded_vocab_size(plan.model.vocab_size, plan.vocab.tp, divisible_by),
        gpt_kwargs=gpt_model_kwargs(plan.model, options),
        pg_collection=_without_cp(pgs[model_layout], groups.singleton),
        block_pg_collection=pgs[out_layout if last else model_layout],
        final_norm=final_norm_spec(use_te=use_te) if last and final_norm else None,
        pre_process=first and embedding, post_process=last and output, vp_stage=vp_stage,
    )


def build_model(
    plan: ParallelPlan,
    config: TransformerConfig | ModelSpec | None = None,
    *,
    groups: PlanGroups | None = None,
    ddp_config: DistributedDataParallelConfig | None = None,
    seed: int = 1234,
    init: str = "plan_invariant",
    wrap_ddp: bool = True,
    embedding: bool = True,
    output_layer: bool = True,
    final_norm: bool = True,
    use_te: bool | None = None,
    make_vocab_size_divisible_by: int = 128,
    model_options: ModelOptions | None = None,
) -> tuple[list[HeteroDDP] | list[HeteroGPTModel], PlanGroups]:
    """Build this rank's pipeline stage of `plan` (collective: every rank calls it): one model
    chunk, or virtual_stages chunks of an interleaved plan (chunk c holds plan.stages[c*pp +
    stage]), each wrapped in its own HeteroDDP as megatron-core's interleaved schedule expects.

    `config` is a megatron `TransformerConfig` for the plan's model (degrees are replaced per
    layer) or a ModelSpec / None for CPU-safe defaults; `model_options` gives the GPTModel
    position settings (rotary base, RoPE scaling, ...; default ModelOptions()).
    `init="plan_invariant"` gives the same weights under every plan for one seed; "megatron"
    keeps megatron-core's own init.
    """
    check_runtime_support(plan, embedding=embedding, output_layer=output_layer)
    resolved = _resolve_config(plan, config)
    if plan.model.moe is not None:
        check_moe_support(plan, resolved)
    if groups is None:
        check_world_size(plan, dist.get_world_size())
    prepare_megatron()
    groups = groups or build_plan_groups(plan)  # incl. the vocabulary passes' layout
    vocab_groups = new_plan_vocab_groups(plan) if plan.vocab.mode == "vocab_parallel" else None
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=groups.local_rank, ep_rank=0,
                                                    etp_rank=0, force_reset_rng=True)
    interleaved = plan.virtual_stages > 1
    models = [_stage_model(plan, resolved, groups, embedding=embedding, output=output_layer,
                           final_norm=final_norm, use_te=use_te,
                           divisible_by=make_vocab_size_divisible_by, options=model_options,
                           vp_stage=c if interleaved else None)
              for c in range(plan.virtual_stages)]
    model = models[0]
    if vocab_groups is not None and embedding:
        model.attach_vocab(VocabParallelLayers(
            config=model.config, vocab_size=model.vocab_size, hidden_size=resolved.hidden_size,
            group=vocab_groups.vocab, tie_embeddings=plan.model.tied_embeddings,
            init_method=resolved.init_method,
            max_position_embeddings=_vocab_positions(plan, groups),
            position_tp_group=model.pg_collection.tp), vocab_groups)
    for model in models:
        if init == "plan_invariant":
            init_plan_invariant(model, seed)
            if model.vocab is not None:
                init_vocab_plan_invariant(model.vocab, model.config, seed)
        elif init != "megatron":
            raise ValueError(f"init={init!r} must be 'plan_invariant' or 'megatron'")
        if plan.precision == "bf16":  # every parameter, norms included, as Float16Module does
            model.bfloat16()
        elif plan.precision == "fp16":
            model.half()
    if not wrap_ddp:
        return models, groups
    chunks = [HeteroDDP(model, ddp_config or DistributedDataParallelConfig()) for model in models]
    for chunk in chunks:
        if init == "megatron":  # megatron's TP-rng init differs between replicas of a shard
            chunk.broadcast_params()
        chunk.module.config.finalize_model_grads_func = finalize_grads
    # the schedule reads chunk 0's config: one no_sync per chunk (a list for the interleaved one)
    no_sync = [chunk.no_sync for chunk in chunks]
    models[0].config.no_sync_func = no_sync if interleaved else no_sync[0]
    return chunks, groups
