"""Multi-latent attention parity harness (imported by spawned ranks): MLA plans through
`build_model`/`forward_backward` against a single-process stock megatron-core `GPTModel` built
from `get_gpt_layer_local_spec(multi_latent_attention=True)` (TP=1) with the same initial weights
(`init_plan_invariant`), data, AdamW and clipping; the rest is runtime_parity's harness.

Without Transformer Engine, megatron-core's local MLA spec builds only with the
`mla_local_attention` CPU patch (its core attention takes MLA's separate q/k and v head widths);
`prepare_megatron` applies it on both sides.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_ext.plan import ParallelPlan
from tests.dist import runtime_parity


def reference_model(plan: ParallelPlan, seed: int, divisible_by: int = 128):
    """Single-process stock GPTModel with MLA layers (local spec), plan-invariant weights."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_ext.geometry.vocab_partition import padded_vocab_size
    from megatron_ext.megatron_adapter.build import prepare_megatron
    from megatron_ext.megatron_adapter.mla_attention import LayerGroupMLASelfAttention
    from megatron_ext.megatron_adapter.transformer_config import (
        gpt_model_kwargs,
        transformer_config,
    )
    from megatron_ext.megatron_adapter.weights import init_plan_invariant

    prepare_megatron()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0,
                                                    force_reset_rng=True)
    model_spec = plan.model
    config = transformer_config(model_spec, precision="fp32")
    spec = get_gpt_layer_local_spec(normalization=model_spec.normalization,
                                    qk_layernorm=model_spec.qk_layernorm,
                                    multi_latent_attention=True)
    if model_spec.mla is not None and model_spec.mla.q_lora_rank is None:
        # megatron-core builds linear_q_proj on the global tp group, which this single-process
        # reference (like the layerwise runtime) never initialises; at TP=1 the subclass only
        # hands it the model's own (singleton) group: the same computation
        attention = dataclasses.replace(spec.submodules.self_attention,
                                        module=LayerGroupMLASelfAttention)
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(
            spec.submodules, self_attention=attention))
    model = GPTModel(
        config=config, transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(model_spec.vocab_size, plan.vocab.tp, divisible_by),
        pg_collection=runtime_parity._singleton_pgc(), **gpt_model_kwargs(model_spec))
    init_plan_invariant(model, seed)
    return model


def reference_run(plan: ParallelPlan, steps: int, seed: int
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """runtime_parity.reference_run with the MLA reference model."""
    original = runtime_parity.reference_model
    runtime_parity.reference_model = reference_model  # type: ignore[assignment]
    try:
        return runtime_parity.reference_run(plan, runtime_parity.make_batches(plan, steps), seed)
    finally:
        runtime_parity.reference_model = original  # type: ignore[assignment]


def parameter_count(plan: ParallelPlan, seed: int) -> int:
    """Parameters of the single-process megatron-core model (padded vocabulary)."""
    return sum(p.numel() for p in reference_model(plan, seed).parameters())
