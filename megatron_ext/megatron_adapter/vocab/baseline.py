"""Stage modules for vocabulary-parallel parity tests and tools/bench_vocab.py.

Legend: s = sequence, b = micro-batch, h = hidden, v = vocabulary rows of a shard.

`build_stage_body` is the opaque transformer body both layouts share: a megatron-core
`TransformerBlock` of this stage's layers (local spec), pre_process=False, with the final norm on
the last stage. `TpVocabStage` is Megatron's own layout around it, the baseline: embedding
(`VocabParallelEmbedding` over TP) on the first stage, output layer (`ColumnParallelLinear` over
TP) and `vocab_parallel_cross_entropy` on the last, run by Megatron's 1F1B schedule. With the
same body objects, the two layouts compute the same model, so losses and gradients must match.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig


def build_stage_body(
    config: TransformerConfig, num_layers: int, *, is_last: bool
) -> TransformerBlock:
    """This stage's layers as a TransformerBlock taking/returning [s, b, h] (parallel_state
    groups); the final norm only on the last stage."""
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    submodules = TransformerBlockSubmodules(
        layer_specs=[spec] * num_layers, layer_norm=spec.submodules.input_layernorm)
    return TransformerBlock(config, submodules, post_layer_norm=True, pre_process=False,
                            post_process=is_last)


def block_forward_step(data_iterator, model: torch.nn.Module):  # type: ignore[no-untyped-def]
    """forward_step_func for a vocabulary-parallel stage whose body is a TransformerBlock:
    hidden states in (set_input_tensor), hidden states out, masked per-token loss."""
    batch = next(data_iterator)
    hidden = model(hidden_states=None, attention_mask=None)  # [s, b, h]
    return hidden, lambda losses: masked_token_loss(batch["loss_mask"], losses)


def masked_token_loss(loss_mask: torch.Tensor, losses: torch.Tensor):  # type: ignore[no-untyped-def]
    """pretrain_gpt.py's loss_func: (sum of masked token losses, token count, report)."""
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses.reshape(-1).float() * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}


class TpVocabStage(torch.nn.Module):
    """Megatron's layout: embedding on the first stage, output layer + loss on the last."""

    def __init__(
        self,
        body: TransformerBlock,
        *,
        vocab_size: int,
        is_first: bool,
        is_last: bool,
        init_method: Callable[[torch.Tensor], None],
    ) -> None:
        super().__init__()
        config = body.config
        self.body, self.config = body, config
        self.model_type = ModelType.encoder_or_decoder
        self.embedding = VocabParallelEmbedding(
            vocab_size, config.hidden_size, init_method=init_method, config=config
        ) if is_first else None
        self.output_layer = ColumnParallelLinear(
            config.hidden_size, vocab_size, config=config, init_method=init_method, bias=False,
            gather_output=False, skip_bias_add=True) if is_last else None
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor | None]) -> None:
        tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        self.input_tensor = tensors[0]

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """tokens, labels: [b, s]. Returns hidden [s, b, h], or on the last stage the
        per-token loss [b, s] (what GPTModel returns with labels)."""
        if self.embedding is not None:
            hidden = self.embedding(tokens).transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        else:
            hidden = self.input_tensor
        self.body.set_input_tensor(hidden)
        hidden = self.body(hidden_states=None, attention_mask=None)  # [s, b, h]
        if self.output_layer is None:
            return hidden
        logits, _ = self.output_layer(hidden)  # [s, b, v/tp]
        loss = vocab_parallel_cross_entropy(logits.float(), labels.t().contiguous())  # [s, b]
        return loss.t().contiguous()  # [b, s]


def tp_vocab_forward_step(data_iterator, model: torch.nn.Module):  # type: ignore[no-untyped-def]
    """forward_step_func for TpVocabStage under Megatron's 1F1B."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["labels"])
    return output, lambda losses: masked_token_loss(batch["loss_mask"], losses)
