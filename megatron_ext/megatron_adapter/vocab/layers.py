"""Megatron-facing modules for vocabulary parallelism: the shards and the stage wrapper.

Legend: V = vocabulary, R = vocabulary-parallel ranks (pp x tp of one model replica), h = hidden.

The shards are Megatron's own modules built over the vocabulary group instead of the TP group:
`VocabParallelEmbedding(tp_group=G)` for the input embedding and `ColumnParallelLinear(tp_group=G)`
for an untied output layer, so initialisation, checkpoint sharding (offsets come from G) and
optimizer handling are Megatron's. Their forward methods are not used: the runtime's S/T/IF/IB
passes (megatron_ext/runtime/vocab/passes.py) read the weights. Tied embeddings are one
parameter: both passes of a rank touch the same vocabulary rows, so the tie stays local.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.enums import ModelType
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.transformer.utils import sharded_state_dict_default

from megatron_ext.geometry.vocab_partition import VocabPartition
from megatron_ext.plan import VocabStrategy
from megatron_ext.planner.vocab.schedule_ops import Op
from megatron_ext.runtime.vocab.comm import VocabCommGroups


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
        max_position_embeddings: int = 0,
        position_tp_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        """`max_position_embeddings` > 0: also hold learned absolute position embeddings
        (first stage; replicated, not split: they are tiny), replicated over
        `position_tp_group` besides the data-parallel replicas (checkpoint replica ids)."""
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
        self.position_embeddings = torch.nn.Embedding(
            max_position_embeddings, hidden_size, dtype=config.params_dtype,
        ) if max_position_embeddings > 0 else None
        self.position_tp_group = position_tp_group

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Megatron's own shard entries: rows split over the vocabulary group (offsets from its
        rank), replicas over `metadata['dp_cp_group']` (the vocabulary replicas)."""
        out = self.embedding.sharded_state_dict(f"{prefix}embedding.", sharded_offsets, metadata)
        if self.output_layer is not None:
            out.update(self.output_layer.sharded_state_dict(f"{prefix}output_layer.",
                                                            sharded_offsets, metadata))
        if self.position_embeddings is not None:
            out.update(sharded_state_dict_default(
                self.position_embeddings, f"{prefix}position_embeddings.", sharded_offsets,
                metadata, tp_group=self.position_tp_group))
        return out

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


@torch.no_grad()
def init_vocab_plan_invariant(layers: VocabParallelLayers, config: ModelParallelConfig,
                              seed: int) -> None:
    """weights.py's plan-invariant init for the shards: the full `[V, h]` tensor a
    single-process model holds under the same name and seed (padding rows zero), sliced."""
    from megatron_ext.megatron_adapter.weights import _init_fn

    part = layers.partition
    rank = torch.distributed.get_rank(layers.embedding.tp_group)
    start = part.shard_start(rank)
    names = {"embedding.word_embeddings.weight": layers.input_weight}
    if layers.output_layer is not None:
        names["output_layer.weight"] = layers.output_weight
    if layers.position_embeddings is not None:
        names["embedding.position_embeddings.weight"] = layers.position_embeddings.weight
    for name, param in names.items():
        rows = part.vocab_size if "position" not in name else param.shape[0]
        state = torch.get_rng_state()
        torch.manual_seed(zlib.crc32(name.encode()) ^ seed)
        full = torch.zeros(max(rows, part.padded_vocab_size), param.shape[1],
                           dtype=torch.float32)
        _init_fn(name, config)(full[:rows])  # [V, h] / [max positions, h]
        torch.set_rng_state(state)
        if "position" in name:
            param.copy_(full[:rows].to(param.dtype))
        else:
            param.copy_(full[start:start + part.shard_size].to(param.dtype))  # [V_pad / R, h]


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
    pass_timer: Callable[[Op, float], None] | None = None
    """Called after every pass / P2P call with its main-thread CPU seconds (benchmarks)."""
    p2p_shapes: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None
    """(recv, send) `[s_loc, b_loc, h]` of this stage's boundaries (heterogeneous runtime: the
    sending stage's last-layer layout); None = Megatron's `[s, b, h]` both ways."""
    hidden_shape: tuple[int, int, int] | None = None
    """`[s_loc, b_loc, h]` of this rank's vocabulary-pass block (the summed embedding, the
    final-norm output); None = Megatron's `[s, b, h]`. The same on every rank."""
    select_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Full `[b, s]` ids / labels -> this rank's `[b_loc, s_loc]` (matching hidden_shape);
    None = all of them."""

    def __post_init__(self) -> None:
        if self.num_barriers not in (1, 2):
            raise ValueError(f"num_barriers={self.num_barriers} must be 1 or 2")
