"""Mixture-of-Experts parity harness (imported by spawned ranks): a plan with MoE layers through
`build_model`/`forward_backward` against a single-process stock megatron-core `GPTModel` (TP=EP=1,
local spec, SequentialMLP experts, the layer pattern of `model.moe.layer_freq`) with the same
initial weights (`init_plan_invariant`; experts by their global index), data, AdamW and clipping.

Routing is deterministic for the comparison: fp32, no input jitter, no forced load balancing, and
random initial weights make ties between router logits (which torch.topk may break either way)
practically impossible; the parallel run differs from the reference by fp32 reduction order only
(~1e-7 relative), far below any gap between the k-th and (k+1)-th logit of a token.

The load-balancing loss of a token block depends on which tokens are in the block (its expert
counts), so the reference runs each micro-batch as the `blocks` data-parallel blocks the MoE
layers see (contiguous rows, data-parallel rank outermost: geometry/activation.py), every MoE layer of
a compared plan having that dp; dense layers are per-sample and indifferent to the split. With
per-token loss the router weighs a block's aux loss by the block's tokens, the reference
normalises by the global loss-token count itself (`MoEAuxLossAutoScaler` scale 1/tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext.plan import ParallelPlan
from tests.dist.runtime_parity import CLIP, LR, WEIGHT_DECAY

_SINGLETON: list = []


def singleton_pgc():
    """A ProcessGroupCollection of this rank alone, every field MoE layers read included."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not _SINGLETON:  # collective: every rank creates every singleton group once
        _SINGLETON.append([dist.new_group([r]) for r in range(dist.get_world_size())])
    one = _SINGLETON[0][dist.get_rank()]
    return ProcessGroupCollection(
        tp=one, cp=one, pp=one, embd=None, pos_embd=None, dp=one, dp_cp=one, intra_dp_cp=one,
        mp=one, tp_cp=one, tp_dp_cp=one, ep=one, expt_tp=one, tp_ep=one, tp_ep_pp=None,
        expt_dp=one, intra_expt_dp=one, intra_dist_opt=one, inter_dist_opt=None)


def reference_model(plan: ParallelPlan, seed: int, *, dispatcher: str = "alltoall"):
    """Single-process stock GPTModel with MoE layers, plan-invariant initial weights."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_ext.megatron_adapter.build import prepare_megatron
    from megatron_ext.megatron_adapter.sp_norm import gpt_block_spec
    from megatron_ext.megatron_adapter.transformer_config import (
        ModelOptions,
        gpt_model_kwargs,
        transformer_config,
    )
    from megatron_ext.megatron_adapter.weights import init_plan_invariant
    from megatron_ext.geometry.vocab_partition import padded_vocab_size

    prepare_megatron()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0,
                                                    force_reset_rng=True)
    options = ModelOptions(moe_token_dispatcher_type=dispatcher)
    config = transformer_config(plan.model, precision="fp32", options=options,
                                calculate_per_token_loss=True)
    model = GPTModel(
        config=config, transformer_layer_spec=gpt_block_spec(config, use_transformer_engine=False,
                                              pp_rank=0),
        vocab_size=padded_vocab_size(plan.model.vocab_size, plan.vocab.tp, 128),
        pg_collection=singleton_pgc(), **gpt_model_kwargs(plan.model, options))
    init_plan_invariant(model, seed)
    return model


def reference_run(plan: ParallelPlan, batches: list[list[dict]], seed: int, *, blocks: int,
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step LM losses (the aux loss only in the gradients, as megatron reports) and full
    gradients of step 1 by global name; each micro-batch runs as `blocks` row blocks."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    model = reference_model(plan, seed)
    named = dict(model.named_parameters())
    decay = [p for n, p in named.items() if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in named.items() if n.endswith(".bias") or p.dim() == 1]
    opt = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0},
                             {"params": decay, "weight_decay": WEIGHT_DECAY}], lr=LR)
    losses, grads = [], {}
    for step, micro in enumerate(batches):
        opt.zero_grad()
        total_tokens = sum(b["loss_mask"].sum() for b in micro)
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) / total_tokens)  # shape [1]
        step_loss = 0.0
        for batch in micro:
            for part in zip(*(batch[k].chunk(blocks) for k in ("tokens", "labels", "loss_mask")),
                            strict=True):
                tokens, labels, mask = part  # [b/blocks, s] each
                positions = torch.arange(plan.seq_length).expand_as(tokens)
                logits = model(tokens, positions, None)  # [b/blocks, s, v]
                ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                     reduction="none")
                loss = (ce * mask.reshape(-1)).sum() / total_tokens
                loss.backward()
                step_loss += loss.item()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in named.items()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(step_loss)
    return losses, grads


def moe_blocks(plan: ParallelPlan) -> int:
    """The data-parallel degree every MoE layer of `plan` shares (the reference's blocks)."""
    dps = {s.dp for i, s in enumerate(plan.layers) if plan.model.is_moe_layer(i)}
    assert len(dps) == 1, f"MoE layers with different dp {dps}: no single-process reference"
    return dps.pop()


def with_dispatcher(config: Any, dispatcher: str) -> Any:
    return dataclasses.replace(config, moe_token_dispatcher_type=dispatcher)


def run_plan(plan: ParallelPlan, *, ref: tuple[list[float], dict], steps: int = 5,
             seed: int = 11, dispatcher: str = "alltoall", loss_rtol: float, grad_rtol: float,
             grad_atol: float) -> dict[str, Any]:
    """Train `plan` for `steps` steps with the given token dispatcher; assert losses and step-1
    grads match the reference."""
    from megatron_ext.megatron_adapter.transformer_config import (
        ModelOptions,
        transformer_config,
    )
    from tests.dist import runtime_parity

    config = transformer_config(plan.model, precision="fp32",
                                options=ModelOptions(moe_token_dispatcher_type=dispatcher))
    return runtime_parity.run_plan(plan, steps=steps, seed=seed, ref=ref, loss_rtol=loss_rtol,
                                   grad_rtol=grad_rtol, grad_atol=grad_atol, config=config)
