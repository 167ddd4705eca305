"""A megatron-core GPTModel that runs one rank's share of a FlexSP micro-batch.

Legend: t = this rank's tokens of its group's packed stream (batch dim b = 1), h = hidden,
d = rotary dim.

`FlexSPGPTModel` is a stock `GPTModel` (embedding, TransformerBlock, final norm, output layer,
`compute_language_model_loss`) whose layers use `FlexSPCoreAttention` (flexsp/attention.py) and
whose rotary embedding is indexed by per-token position ids: a rank may hold tokens 900-1000 of
one sequence and 0-40 of the next, so positions restart at 0 for every packed sequence instead
of following the packed offset (FlexSP §7.2 "position ids restart per sequence"). Everything
else, including the checkpoint layout, is GPTModel's, so a FlexSP checkpoint loads into a stock
GPTModel and back.

`flexsp_forward` is one micro-batch: packed ids/labels/loss-mask rows in, this rank's summed
masked token loss out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.flexsp.attention import (
    flexsp_layer_spec,
    flexsp_packed_seq_params,
)
from megatron_ext.planner.flexsp.step_plan import StepPlan
from megatron_ext.runtime.flexsp.dispatch import (
    RankMicroBatch,
    dispatch_sequences,
    position_ids,
    rank_microbatches,
)
from megatron_ext.runtime.flexsp.groups import FlexSPGroups
from megatron_ext.runtime.flexsp.step import global_token_count, run_microbatches

__all__ = ["ROW_COLUMNS", "FlexSPGPTModel", "build_flexsp_gpt", "flexsp_forward", "flexsp_step"]

ROW_COLUMNS = 3
"""Per-token columns the dispatcher moves: input id, label, loss mask (0/1)."""


class FlexSPGPTModel(GPTModel):
    """GPTModel with per-sequence RoPE positions for packed FlexSP micro-batches."""

    def _preprocess(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    decoder_input: torch.Tensor | None = None, inference_context: Any = None,
                    packed_seq_params: Any = None, padding_mask: Any = None) -> tuple:
        # packed_seq_params=None: GPTModel would otherwise treat its cp_group (our Ulysses
        # group) as a context-parallel group and slice the rotary table for it.
        out = super()._preprocess(input_ids, position_ids, decoder_input=decoder_input,
                                  inference_context=inference_context, packed_seq_params=None,
                                  padding_mask=padding_mask)
        if self.position_embedding_type != "rope":
            return out  # learned absolute embeddings already read position_ids
        positions = position_ids.reshape(-1)  # [t]
        table = self.rotary_pos_emb(int(positions.max()) + 1 if positions.numel() else 1)
        rope = table[positions]  # [t, 1, 1, d]: each token's own position in its sequence
        return (out[0], rope, *out[2:])


def build_flexsp_gpt(config: TransformerConfig, *, vocab_size: int, max_sequence_length: int,
                     position_embedding_type: str = "rope", tied_embeddings: bool = False,
                     **rope_kwargs: Any) -> FlexSPGPTModel:
    """A single-stage FlexSP GPT on the local (megatron-core) layer spec; `rope_kwargs`: GPTModel's
    rotary_percent, rotary_base, rope_scaling, ... (transformer_config.gpt_model_kwargs)."""
    if position_embedding_type not in ("rope", "learned_absolute"):
        raise PlanError(f"FlexSP supports position_embedding_type rope or learned_absolute, got "
                        f"{position_embedding_type!r}; use --position-embedding-type rope")
    return FlexSPGPTModel(
        config=config,
        transformer_layer_spec=flexsp_layer_spec(normalization=config.normalization,
                                                 qk_layernorm=config.qk_layernorm),
        vocab_size=vocab_size, max_sequence_length=max_sequence_length,
        pre_process=True, post_process=True,
        share_embeddings_and_output_weights=tied_embeddings,
        position_embedding_type=position_embedding_type, **rope_kwargs,
    )


def flexsp_forward(model: torch.nn.Module, view: RankMicroBatch, rows: torch.Tensor,
                   group: dist.ProcessGroup | None) -> torch.Tensor:
    """Summed masked token loss of this rank's tokens of one micro-batch (a scalar).

    `rows`: [t, ROW_COLUMNS] (input id, label, loss mask) as the dispatcher delivered them;
    `model` is a FlexSPGPTModel, possibly wrapped (DDP, Float16Module).
    """
    ids = rows[:, 0].unsqueeze(0)  # [1, t]
    labels = rows[:, 1].unsqueeze(0)  # [1, t]
    mask = rows[:, 2].float()  # [t]
    positions = position_ids(view, device=rows.device).unsqueeze(0)  # [1, t]
    psp = flexsp_packed_seq_params(view, group, device=rows.device)
    losses = model(ids, positions, None, labels=labels, packed_seq_params=psp)  # [1, t] fp32
    return (losses.float().reshape(-1) * mask).sum()


def _idle_view(rank: int) -> RankMicroBatch:
    """A one-token, degree-1 micro-batch with its loss masked out (see flexsp_step)."""
    return RankMicroBatch(microbatch=-1, group_start=rank, degree=1, seq_ids=(-1,),
                          cu_seqlens=(0, 1), token_counts=(1,), pieces=((-1, 0, 1),),
                          group_rank=0)


def flexsp_step(ddp: Any, plan: StepPlan, local: dict[int, torch.Tensor], owners: list[int], *,
                groups: FlexSPGroups, forward_only: bool = False,
                group: dist.ProcessGroup | None = None) -> float:
    """One FlexSP step of a megatron-DDP-wrapped FlexSPGPTModel; returns the global mean loss.

    `local`: seq id -> [s_i, ROW_COLUMNS] rows of the sequences this rank loaded; `owners[i]`:
    the rank that loaded sequence i; `group`: the ranks of the plan (default: world), which are
    also DDP's data-parallel group. The DDP must sum gradients (TransformerConfig
    `calculate_per_token_loss=True`): each rank's loss is its summed token loss over the global
    labelled-token count, so the sum over ranks is the gradient of the global per-token mean.
    Gradients are left reduced in DDP's buffers (reduce-scattered with ZeRO-1).
    """
    rank = dist.get_rank(group)
    device = next(ddp.parameters()).device
    local = {seq: r.to(device) for seq, r in local.items()}  # loaders yield host tensors
    rows = dispatch_sequences(plan, rank, local, owners, columns=ROW_COLUMNS, device=device,
                              group=group)
    views = rank_microbatches(plan, rank)
    if not forward_only and all(v is None for v in views):
        # A rank idle for the whole step still runs one masked token, so that every DDP
        # parameter hook fires and its (zero) gradients join the reduction like everyone's.
        views, rows = [_idle_view(rank)], [torch.zeros(1, ROW_COLUMNS, dtype=torch.long,
                                                       device=device)]
    num_tokens = global_token_count(rows, label_column=2, ignore_index=0, group=group)
    if num_tokens == 0:
        raise PlanError("a FlexSP step has no labelled token (every loss_mask is 0); check "
                        "--eod-mask-loss and the data")
    share = run_microbatches(
        views, rows, lambda v, r, g: flexsp_forward(ddp, v, r, g), groups=groups,
        num_loss_tokens=num_tokens, no_sync=None if forward_only else ddp.no_sync,
        forward_only=forward_only)
    if not forward_only:
        ddp.finish_grad_sync()
    dist.all_reduce(share, group=group)
    return float(share.item())
