"""What the loop needs from a model: built chunks, optimizer, data shard, and a step function.

Legend: b = samples in one rank's micro-batch, s = seq_length, v = padded vocabulary.

`Backend` is the small interface between the training loop and whoever builds the model:
stock_backend.py (plans megatron-core expresses on its own), runtime_backend.py (the layerwise
runtime) and flexsp_backend.py build one; select.py decides which runs a plan.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_ext.megatron_adapter.sp_norm import have_transformer_engine
from megatron_ext.megatron_adapter.training.data import DataShard

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, eq=False)
class Backend:
    """A built model and optimizer for this rank, as the loop and checkpoints use them."""

    model: list[torch.nn.Module]
    """Model chunks of this rank (megatron-core DDP-wrapped)."""
    optimizer: Any
    """megatron-core MegatronOptimizer (or ChainedOptimizer)."""
    config: Any
    """TransformerConfig the schedule reads hooks from."""
    shard: DataShard
    """Which slice of every global micro-batch this rank reads."""
    micro_batch_size: int
    """Samples of one micro-batch on this rank."""
    needs_data: bool
    """True on the stages that read tokens or labels (first and last)."""
    dp_cp_group: Any
    """Group over which replicated state is sharded in checkpoints."""
    forward_backward: Callable[..., float]
    """(data_iterator, num_microbatches, forward_only) -> the step's global mean token loss,
    the same on every rank (gradients are left finalized in the grad buffers)."""
    padded_vocab_size: int
    """Output-layer rows; part of the checkpoint's shape contract."""
    model_format: str = "megatron"
    """Checkpoint key layout: "megatron" (stock GPTModel, Megatron-LM compatible) or
    "layerwise" (the heterogeneous runtime's per-layer keys)."""

    def sharded_state_dict(self, metadata: dict[str, Any]) -> dict[str, Any]:
        """Model state, keyed by global layer index so any plan can load it."""
        # `.module`: DDP has no sharded_state_dict override (mcore_cpu.md section 8.3).
        if len(self.model) == 1:
            return {"model": self.model[0].module.sharded_state_dict(metadata=metadata)}
        return {f"model{i}": chunk.module.sharded_state_dict(metadata=metadata)
                for i, chunk in enumerate(self.model)}

    def load_model_state(self, state: dict[str, Any]) -> None:
        if len(self.model) == 1:
            self.model[0].module.load_state_dict(state["model"], strict=True)
            return
        for i, chunk in enumerate(self.model):
            chunk.module.load_state_dict(state[f"model{i}"], strict=True)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[Any, ...]:
    """Megatron-LM pretrain_gpt's loss: (sum of masked token losses, tokens, report)."""
    losses = output_tensor.float().view(-1)  # [b*s]
    mask = loss_mask.float().view(-1)  # [b*s]
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])  # [2]
    return loss, num_tokens, {"lm loss": report}


def forward_step(cp_group: Any, data_iterator: Iterator | None, model: torch.nn.Module) -> Any:
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is None:  # a middle pipeline stage: activations come from the previous stage
        return model(None, None, None), partial(loss_func, None)
    if cp_group is not None and cp_group.size() > 1:
        batch = get_batch_on_this_cp_rank(batch, cp_group=cp_group)  # [b, s/cp] each
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"], loss_mask=batch["loss_mask"])  # [b, s] token losses
    return output, partial(loss_func, batch["loss_mask"])


def use_transformer_engine(args: argparse.Namespace) -> bool:
    """--transformer-impl transformer_engine (Megatron's default) when TE is importable."""
    wanted = getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine"
    if wanted and not have_transformer_engine():
        logger.warning("--transformer-impl transformer_engine: transformer-engine is not "
                       "installed, using the local (megatron-core) layers")
    return wanted and have_transformer_engine()
