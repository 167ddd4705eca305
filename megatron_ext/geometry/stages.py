"""Layouts a ParallelPlan needs per pipeline stage: layer layouts, vocabulary layouts, boundaries.

Legend: s = sequence, b = micro-batch (all replicas), S = ranks per stage, vtp = plan.vocab.tp.

- Layer l runs in `ActivationLayout.of(plan.layers[l])`.
- The embedding (first stage) and the output layer with its loss (last stage) run over the vocab
  tensor-parallel group of vtp ranks. When the neighbouring layer has tp == vtp they reuse that
  layer's layout (no re-layout, exactly Megatron's uniform case); otherwise the remaining S/vtp
  ranks split the batch as far as the micro-batch allows and the sequence for the rest.
- Stage boundaries carry the sending stage's last-layer layout: senders never re-layout, the
  receiving stage does, and each stage's recv/send shapes are known from the plan alone.
- Interleaved plans (virtual_stages > 1): megatron-core's interleaved schedule passes one tensor
  shape for every message, so every chunk boundary carries one layout, `chunk_boundary_layout`
  (the first chunk's last layer's): a chunk re-lays its input from it and its output to it.
"""

from __future__ import annotations

import dataclasses

from megatron_ext.errors import PlanError
from megatron_ext.geometry.activation import ActivationLayout
from megatron_ext.geometry.vocab import vocab_parallel_layout
from megatron_ext.plan import LayerStrategy, ParallelPlan

__all__ = [
    "boundary_layout",
    "chunk_boundary_layout",
    "embedding_layout",
    "output_layout",
    "stage_layouts",
    "stage_of_rank",
]


def stage_of_rank(plan: ParallelPlan, rank: int) -> tuple[int, int]:
    """(pipeline stage, local rank inside the stage) of a global rank."""
    return rank // plan.stage_width, rank % plan.stage_width


def _vocab_layout(plan: ParallelPlan, neighbour: LayerStrategy) -> ActivationLayout:
    vtp = plan.vocab.tp
    if neighbour.tp == vtp:
        return ActivationLayout.of(neighbour)
    rest = plan.stage_width // vtp
    dp = max(d for d in range(1, rest + 1) if rest % d == 0 and plan.micro_batch_size % d == 0)
    seq = rest // dp
    sp = vtp > 1 and plan.seq_length % (seq * vtp) == 0
    if plan.seq_length % (seq * (vtp if sp else 1)):
        raise PlanError(
            f"seq_length={plan.seq_length} cannot be split over the {seq} vocabulary-layer "
            f"ranks that micro_batch_size={plan.micro_batch_size} leaves; use a micro-batch "
            f"size that is a multiple of {rest} or a seq_length divisible by {seq}"
        )
    return ActivationLayout(tp=vtp, sp=sp, ulysses=seq, dp=dp)


def embedding_layout(plan: ParallelPlan) -> ActivationLayout:
    """Layout of the embedding output on the first stage."""
    return _vocab_layout(plan, plan.layers[0])


def output_layout(plan: ParallelPlan) -> ActivationLayout:
    """Layout of the final norm, output layer and loss on the last stage.

    With pp = 1 it shares the embedding layout's sp flag: both run under one model config.
    """
    layout = _vocab_layout(plan, plan.layers[-1])
    if plan.pp == 1 and layout.sp != embedding_layout(plan).sp:
        layout = dataclasses.replace(layout, sp=not layout.sp)
    return layout


def boundary_layout(plan: ParallelPlan, stage: int) -> ActivationLayout:
    """Layout of the activation stage `stage` sends to stage `stage + 1`."""
    return ActivationLayout.of(plan.layers[plan.stages[stage][1] - 1])


def chunk_boundary_layout(plan: ParallelPlan) -> ActivationLayout:
    """The one layout every chunk boundary of an interleaved plan carries."""
    return ActivationLayout.of(plan.layers[plan.stages[0][1] - 1])


def chunk_shape(plan: ParallelPlan, hidden: int) -> tuple[int, int, int]:
    """`[s_loc, b_loc, h]` of every message of an interleaved plan."""
    s_loc, b_loc = chunk_boundary_layout(plan).local_shape(plan.seq_length,
                                                           plan.micro_batch_size)
    return (s_loc, b_loc, hidden)


def stage_layouts(plan: ParallelPlan, stage: int, *, vocab: bool = True) -> list[ActivationLayout]:
    """Distinct layouts used on `stage`, in first-use order (layers, then vocabulary layers;
    under vocabulary parallelism every stage also holds the vocabulary passes' layout;
    interleaved plans: the layers of all the stage's chunks and the chunk boundary layout)."""
    found = [ActivationLayout.of(plan.layers[i]) for i in plan.stage_layers(stage)]
    if plan.virtual_stages > 1:
        found.append(chunk_boundary_layout(plan))
    if vocab and plan.vocab.mode == "vocab_parallel":
        found.append(vocab_parallel_layout(plan))
    if vocab and stage == 0:
        found.insert(0, embedding_layout(plan))
    if vocab and stage == plan.pp - 1:
        found.append(output_layout(plan))
    return list(dict.fromkeys(found))


def stage_shapes(plan: ParallelPlan, stage: int, hidden: int) -> tuple[list, list]:
    """([recv shape], [send shape]) of `stage`: `[s_loc, b_loc, h]` of the boundary layouts."""
    def shape(boundary: int) -> tuple[int, int, int]:
        s_loc, b_loc = boundary_layout(plan, boundary).local_shape(plan.seq_length,
                                                                  plan.micro_batch_size)
        return (s_loc, b_loc, hidden)

    recv = [shape(stage - 1)] if stage > 0 else [()]
    send = [shape(stage)] if stage < plan.pp - 1 else [()]
    return recv, send
