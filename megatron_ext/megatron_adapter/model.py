"""`HeteroGPTModel`: megatron-core's `GPTModel` with a per-layer-strategy decoder, and
`build_model`.

Legend: s = sequence, b = micro-batch (all data-parallel replicas), h = hidden,
v = padded vocabulary, vtp = plan.vocab.tp; local blocks per `geometry/activation.py`.

`GPTModel.__init__` supplies the embedding, rotary table, output layer, tied-weight setup and
checkpoint keys, all over the vocabulary tp group; the decoder is replaced by
`HeteroTransformerBlock`. `forward` takes the *full* micro-batch (`[b, s]` token ids, labels, on
every rank of the stage) and slices the part of its layout itself; with labels it returns the
per-token loss of this rank's tokens, `[b_loc, s_loc]` (`local_tokens` slices a loss mask the
same way), from a cross entropy over the vocabulary tp group.

Body-only stages (no embedding / no output layer, for vocabulary parallelism): pass
`decoder_input` `[s_loc, b_loc, h]` in `model.decoder.input_layout` on the first stage; the last
stage returns hidden states in `model.decoder.output_layout` (after the final norm when
`final_norm=True`). Under vocab.mode vocab_parallel both are `vocab_parallel_layout(plan)` and
every stage holds its vocabulary shards in `model.vocab` (`attach_vocab`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

from megatron_ext.geometry.activation import ActivationLayout
from megatron_ext.geometry.vocab import vocab_parallel_layout
from megatron_ext.megatron_adapter.block import HeteroTransformerBlock, LayerBuild
from megatron_ext.megatron_adapter.cross_entropy import (
    group_vocab_parallel_cross_entropy,
)
from megatron_ext.megatron_adapter.fsdp import shard_full_state
from megatron_ext.megatron_adapter.vocab.layers import VocabParallelLayers
from megatron_ext.plan import ParallelPlan
from megatron_ext.runtime.groups import PlanGroups
from megatron_ext.runtime.redistribute import local_tokens
from megatron_ext.runtime.vocab.comm import VocabCommGroups

__all__ = ["HeteroGPTModel"]


_VOCAB_KEYS = (("vocab.embedding.", "embedding.word_embeddings."),
               ("vocab.position_embeddings.", "embedding.position_embeddings."),
               ("vocab.output_layer.", "output_layer."))
"""Vocabulary-parallel shards under GPTModel's checkpoint keys (same global shapes: rows of
the padded vocabulary), so vocab_parallel and tp-vocabulary plans load each other."""


def _stock_vocab_keys(sharded: dict, prefix: str) -> None:
    sharded.pop(f"{prefix}vocab.output_layer._extra_state", None)  # as GPTModel drops its own

    def rename(entry: Any) -> Any:
        key = getattr(entry, "key", None)
        for old, new in _VOCAB_KEYS:
            if isinstance(key, str) and key.startswith(prefix + old):
                entry.key = prefix + new + key[len(prefix + old):]
        return entry

    dict_list_map_inplace(rename, sharded)


class HeteroGPTModel(GPTModel):
    """One pipeline stage of a GPT model whose layers follow a ParallelPlan."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        plan: ParallelPlan,
        groups: PlanGroups,
        builds: list[LayerBuild],
        input_layout: ActivationLayout,
        output_layout: ActivationLayout,
        vocab_size: int,
        gpt_kwargs: dict[str, Any],
        pg_collection: ProcessGroupCollection,
        block_pg_collection: ProcessGroupCollection,
        final_norm: Any | None,
        pre_process: bool,
        post_process: bool,
        vp_stage: int | None = None,
    ) -> None:
        super().__init__(
            config=config,
            transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[], layer_norm=None),
            vocab_size=vocab_size, pre_process=pre_process, post_process=post_process,
            pg_collection=pg_collection, vp_stage=vp_stage,
            **gpt_kwargs,  # transformer_config.gpt_model_kwargs
        )
        self.plan = plan
        self.groups = groups
        self.vocab: VocabParallelLayers | None = None
        """vocab.mode vocab_parallel: this rank's shards of both vocabulary layers."""
        self.vocab_groups: VocabCommGroups | None = None
        self.batch_shard: tuple[int, int] = (0, 1)
        """(index, count): the batches this stage gets hold rows [index*b/count,
        (index+1)*b/count) of each micro-batch (training/layerwise_backend.py sets it)."""
        self.decoder = HeteroTransformerBlock(
            config, builds=builds, groups=groups, input_layout=input_layout,
            output_layout=output_layout, final_norm=final_norm,
            pg_collection=block_pg_collection, pre_process=pre_process,
            post_process=final_norm is not None,
        )

    def attach_vocab(self, layers: VocabParallelLayers, groups: VocabCommGroups) -> None:
        """Vocabulary parallelism: hold `layers` (trained with this stage's parameters) and the
        groups the vocabulary passes use (vocab/schedule.py reads both)."""
        assert not self.pre_process and not self.post_process, "vocabulary shards need a body"
        self.vocab, self.vocab_groups = layers, groups

    def vocab_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full `[b, s]` ids / labels / loss mask -> this rank's `[b_loc, s_loc]` part in the
        vocabulary passes' layout (geometry/vocab.py)."""
        return local_tokens(tokens, vocab_parallel_layout(self.plan), self.groups.local_rank,
                            self.batch_shard)

    def _add_vocab_positions(self, position_ids: torch.Tensor | None, seq_length: int) -> None:
        """First stage under vocabulary parallelism with learned absolute positions: the stage
        input (summed word embeddings `[s_loc, b_loc, h]`, vocabulary layout) plus this rank's
        position embeddings, as megatron's LanguageModelEmbedding adds them."""
        hidden = self.decoder.input_tensor  # [s_loc, b_loc, h]
        if position_ids is None:
            batch = hidden.shape[1] * vocab_parallel_layout(self.plan).dp // self.batch_shard[1]
            position_ids = torch.arange(seq_length, device=hidden.device).expand(batch, -1)
        positions = self.vocab_tokens(position_ids)  # [b_loc, s_loc]
        assert self.vocab is not None and self.vocab.position_embeddings is not None
        pos = self.vocab.position_embeddings(positions).transpose(0, 1)  # [s_loc, b_loc, h]
        self.decoder.set_input_tensor(hidden + pos)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """GPTModel's, with replica ids over the vocabulary layers' own dp_cp group (the decoder
        sets each layer's); a caller's `dp_cp_group` (one group for a uniform model) is
        replaced."""
        metadata = {**(metadata or {}), "dp_cp_group": self.pg_collection.dp_cp}
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.vocab is not None:
            _stock_vocab_keys(out, prefix)
        return out

    def tie_embeddings_and_output_weights_state_dict(
        self, sharded_state_dict: dict, output_layer_weight_key: str,
        first_stage_word_emb_key: str, metadata: dict | None = None,
    ) -> None:
        """LanguageModule's (language_module.py:311), with the replica id's dp rank taken from
        `metadata['dp_cp_group']` instead of the global parallel_state."""
        if not self.post_process or self.pre_process:
            return  # no output layer here, or it is the embedding already
        del sharded_state_dict[output_layer_weight_key]
        group = (metadata or {})["dp_cp_group"]
        sharded_state_dict[output_layer_weight_key] = make_tp_sharded_tensor_for_checkpoint(
            tensor=self.shared_embedding_or_output_weight(), key=first_stage_word_emb_key,
            replica_id=(1, 0, dist.get_rank(group)),  # a copy of the first stage's embedding
            allow_shape_mismatch=True, tp_group=self.tp_group, dp_cp_group=group,
        )

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Full tensors (as checkpoints hold them) of ZeRO-2/3 layers are cut to their FSDP2
        shards first (fsdp.shard_full_state)."""
        return super().load_state_dict(shard_full_state(self, state_dict), strict=strict,
                                       assign=assign)

    def local_tokens(self, tokens: torch.Tensor, *, at_input: bool = False) -> torch.Tensor:
        """This rank's `[b_loc, s_loc]` part of full `[b, s]` ids / labels / loss mask: the
        tokens the output layer sees (its input is SP-gathered), or with `at_input` the tokens
        the embedding looks up (it reduce-scatters to SP itself)."""
        layout = self.decoder.input_layout if at_input else self.decoder.output_layout
        return local_tokens(tokens, layout.attention_layout(), self.groups.local_rank,
                            self.batch_shard)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **_unused: Any,
    ) -> torch.Tensor:
        """Full `[b, s]` input_ids/labels -> per-token loss `[b_loc, s_loc]` (with labels),
        logits `[b_loc, s_loc, v/vtp]` (without), or hidden states (no output layer)."""
        if decoder_input is None and self.pre_process:
            assert input_ids is not None, "the first stage reads token ids"
            ids = self.local_tokens(input_ids, at_input=True)  # [b_loc, s_loc]
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
                position_ids = position_ids.expand_as(input_ids)
            positions = self.local_tokens(position_ids, at_input=True)  # [b_loc, s_loc]
            decoder_input = self.embedding(input_ids=ids, position_ids=positions)
        seq_length = (input_ids.shape[1] if input_ids is not None
                      else self.decoder.global_seq_length(
                          decoder_input if decoder_input is not None
                           else self.decoder.input_tensor))
        if self.vocab is not None and self.vocab.position_embeddings is not None:
            self._add_vocab_positions(position_ids, seq_length)
        rope = None
        if self.position_embedding_type == "rope" and not self.config.multi_latent_attention:
            rope = self.rotary_pos_emb(seq_length)  # [s, 1, 1, d]; MLA layers make their own
        hidden = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                              rotary_pos_emb=rope)  # [s_loc, b_loc, h] in output_layout
        if not self.post_process:
            return hidden
        weight = (self.shared_embedding_or_output_weight()
                  if self.share_embeddings_and_output_weights else None)
        logits, _ = self.output_layer(hidden, weight=weight)  # [s_loc, b_loc, v/vtp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b_loc, s_loc, v/vtp]
        target = self.local_tokens(labels).transpose(0, 1).contiguous()  # [s_loc, b_loc]
        loss = group_vocab_parallel_cross_entropy(logits, target, self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()  # [b_loc, s_loc]
