"""Megatron-facing modules for vocabulary parallelism: the shards and the stage wrapper.

Legend: V = vocabulary, R = vocabulary-parallel ranks (pp x tp of one model replica), h = hidden.

The shards are Megatron's own modules built over the vocabulary group instead of the TP group:
`VocabParallelEmbedding(tp_group=G)` for the input embedding and `ColumnParallelLinear(tp_group=G)`
for an untied output layer, so initialisation, checkpoint sharding (offsets come from G) and
optimizer handling are Megatron's. Their forward methods are not used: the runtime's S/T/IF/IB
passes (megatron_ext/runtime/vocab_parallel.py) read the weights. Tied embeddings are one
parameter: both passes of a rank touch the same vocabulary rows, so the tie stays local.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.enums import ModelType
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
)

from megatron_ext.plan import VocabStrategy
from megatron_ext.runtime.vocab_parallel import Op, VocabCommGroups, VocabPartition


def num_barriers_for(vocab: VocabStrategy) -> int:
    """Communication barriers of the plan's algorithm. plan.py numbers them as barriers (1: one
    barrier, p+1 activations; 2: two barriers, p+2); the paper calls these Algorithm 2 / 1."""
    if vocab.mode != "vocab_parallel":
        raise ValueError(f"vocab.mode={vocab.mode!r}: vocabulary-parallel passes need "
                         "mode vocab_parallel")
    return vocab.algorithm


class VocabParallelLayers(torch.nn.Module):
    """This rank's shards of the input embedding and the output layer, [V_pad / R, h] each."""

    def __init__(
        self,
        *,
        config: ModelParallelConfig,
        vocab_size: int,
        hidden_size: int,
        group: torch.distributed.ProcessGroup,
        tie_embeddings: bool,
        init_method: Callable[[torch.Tensor], None],
        make_vocab_size_divisible_by: int = 1,
    ) -> None:
        super().__init__()
        self.partition = VocabPartition.create(
            vocab_size, group.size(), divisible_by=make_vocab_size_divisible_by)
        padded = self.partition.padded_vocab_size
        self.embedding = VocabParallelEmbedding(
            padded, hidden_size, init_method=init_method, config=config, tp_group=group)
        self.output_layer = None if tie_embeddings else ColumnParallelLinear(
            hidden_size, padded, config=config, init_method=init_method, bias=False,
            gather_output=False, skip_bias_add=True, tp_group=group)
        assert self.embedding.vocab_start_index == self.partition.shard_start(group.rank())

    @property
    def input_weight(self) -> torch.nn.Parameter:
        return self.embedding.weight

    @property
    def output_weight(self) -> torch.nn.Parameter:
        return self.embedding.weight if self.output_layer is None else self.output_layer.weight


class VocabParallelStage(torch.nn.Module):
    """A pipeline stage under vocabulary parallelism: an opaque transformer body plus the
    vocabulary shards every stage holds.

    `body` maps hidden states [s, b, h] to hidden states [s, b, h] and takes its input through
    `set_input_tensor` (Megatron's pipeline convention; the first stage gets the summed input
    embedding). The last stage's body must end with the final norm. A megatron-core
    `TransformerBlock(pre_process=False, post_process=is_last)` or `GPTModel(pre_process=False,
    post_process=False)` fits; so will the heterogeneous runtime's stage modules. Megatron's
    schedule helpers and DDP see an ordinary module: forward goes to the body.
    """

    def __init__(self, body: torch.nn.Module, vocab: VocabParallelLayers) -> None:
        super().__init__()
        self.body = body
        self.vocab = vocab
        self.config = body.config
        self.model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor | None]) -> None:
        tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        assert len(tensors) == 1, "a vocabulary-parallel stage takes one input tensor"
        self.body.set_input_tensor(tensors[0])

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.body(*args, **kwargs)


@dataclass(frozen=True, kw_only=True, slots=True)
class VocabScheduleOptions:
    """What the vocabulary-parallel schedule needs besides Megatron's schedule arguments."""

    groups: VocabCommGroups
    """The vocabulary group (all pp x tp ranks of this replica) and its per-kind duplicates."""
    num_barriers: int = 1
    """1 (one barrier, p+1 micro-batches of activations) or 2 (two barriers, p+2)."""
    layers_per_stage: tuple[int, ...] = ()
    """Transformer layers per pipeline stage, for analytic pass placement; () = equal stages.
    Must be identical on every rank (the pass order is computed on each)."""
    ffn_hidden_size: int = 0
    """FFN width for the placement costs; 0 = 4 x hidden."""
    thread_initializer: Callable[[], None] | None = None
    """Runs once in each communication worker thread (profilers)."""
    pass_timer: Callable[[Op, float], None] | None = None
    """Called after every pass / P2P call with its main-thread CPU seconds (benchmarks)."""

    def __post_init__(self) -> None:
        if self.num_barriers not in (1, 2):
            raise ValueError(f"num_barriers={self.num_barriers} must be 1 or 2")
