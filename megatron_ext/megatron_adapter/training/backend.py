"""What the loop needs from a model: built chunks, optimizer, data shard, and a step function.

`Backend` is the small interface between the training loop and whoever builds the model:
stock_backend.py (plans megatron-core expresses on its own), runtime_backend.py (the layerwise
runtime) and flexsp_backend.py build one; select.py decides which runs a plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from megatron_ext.megatron_adapter.training.data import DataShard


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
    rank_micro_batch_size: int
    """Samples of one micro-batch this rank reads (its `shard` of the global micro-batch)."""
    needs_data: bool
    """True on the stages that read tokens or labels (first and last)."""
    dp_cp_group: Any
    """Group over which replicated state is sharded in checkpoints."""
    forward_backward: Callable[..., float]
    """(data_iterator, num_microbatches, forward_only) -> the step's global mean token loss,
    the same on every rank (gradients are left finalized in the grad buffers). Every backend
    runs losses.forward_step / losses.loss_func (FlexSP: its own step, the same loss check)."""
    padded_vocab_size: int
    """Output-layer rows; part of the checkpoint's shape contract."""
    name: Literal["stock", "layerwise", "flexsp"]
    """Which backend built it (select.py decides)."""
    step_metrics: dict[str, float] = field(default_factory=dict)
    """Extra values of the last training step the log line shows after the lm loss (MoE
    models: Megatron-LM's router losses, e.g. load_balancing_loss), the same on every rank."""
    model_format: str = "megatron"
    """Which optimizer chain the checkpoint's optimizer state has: "megatron" (one megatron-core
    optimizer per rank: the stock and FlexSP backends) or "layerwise" (the layerwise runtime's
    chain of one optimizer per gradient class). The tensors' keys are the same for both."""

    def sharded_state_dict(self, metadata: dict[str, Any]) -> dict[str, Any]:
        """Model state, keyed by global layer index so any plan can load it."""
        # `.module`: DDP has no sharded_state_dict override (megatron/core/distributed/
        # data_parallel_base.py `_BaseDataParallel`): the wrapper would prefix every key.
        if len(self.model) == 1:
            return {"model": self.model[0].module.sharded_state_dict(metadata=metadata)}
        if self.model_format == "layerwise":  # chunks' keys are global layer indices: one dict
            merged: dict[str, Any] = {}
            for chunk in self.model:
                merged.update(chunk.module.sharded_state_dict(metadata=metadata))
            return {"model": merged}
        return {f"model{i}": chunk.module.sharded_state_dict(metadata=metadata)
                for i, chunk in enumerate(self.model)}

    def load_model_state(self, state: dict[str, Any]) -> None:
        if len(self.model) == 1:
            self.model[0].module.load_state_dict(state["model"], strict=True)
            return
        if self.model_format == "layerwise":
            for chunk in self.model:
                own = chunk.module.state_dict().keys()
                chunk.module.load_state_dict({k: v for k, v in state["model"].items()
                                              if k in own}, strict=True)
            return
        for i, chunk in enumerate(self.model):
            chunk.module.load_state_dict(state[f"model{i}"], strict=True)
