"""The one contract between the training loop and whoever builds and steps the model.

`Backend` is an abstract base every backend implements; `select.py` is the one place that
decides which runs a plan and builds it:

- `StockBackend` (stock_backend.py): plans megatron-core expresses on its own;
- `LayerwiseBackend` (layerwise_backend.py): the layerwise heterogeneous runtime;
- `VocabParallelBackend` (vocab_backend.py): the layerwise runtime with the vocabulary passes
  scheduled into 1F1B on every stage;
- `FlexSPBackend` (flexsp_backend.py): per-step Ulysses groups of different sizes.

The loop (`loop.train_step`, `loop.evaluate`), checkpoints and the tests and benchmarks all go
through `Backend.forward_backward`; nothing else runs a step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
import torch.distributed as dist

from megatron_ext.megatron_adapter.training.data import DataShard

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.mapping import ShardedStateDict, StateDict
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.transformer import TransformerConfig

__all__ = ["Backend", "BackendName", "ChainFormat"]

BackendName = Literal["stock", "layerwise", "vocab_parallel", "flexsp"]
ChainFormat = Literal["megatron", "layerwise"]
"""How a backend chains optimizers on a rank, as checkpoints record it: "megatron" (one
megatron-core optimizer per rank) or "layerwise" (one optimizer per gradient class). The
tensors' keys are the same for both."""

Batch = dict[str, torch.Tensor]


@dataclass(kw_only=True, eq=False)
class Backend(ABC):
    """A built model and optimizer for this rank, as the loop and checkpoints use them."""

    name: ClassVar[BackendName]
    """Which backend this is (select.py decides)."""
    chain_format: ClassVar[ChainFormat] = "megatron"
    """How this backend chains optimizers (see ChainFormat)."""

    model: list[torch.nn.Module]
    """Model chunks of this rank, each DDP-wrapped (megatron-core DDP or HeteroDDP)."""
    optimizer: MegatronOptimizer
    """megatron-core MegatronOptimizer (a ChainedOptimizer on the layerwise runtime)."""
    config: TransformerConfig
    """TransformerConfig the schedule reads its hooks from."""
    shard: DataShard
    """Which slice of every global micro-batch this rank reads."""
    rank_micro_batch_size: int
    """Samples of one micro-batch this rank reads (its `shard` of the global micro-batch)."""
    needs_data: bool
    """True on the ranks that read tokens or labels."""
    dp_cp_group: dist.ProcessGroup
    """Group over which replicated state is sharded in checkpoints."""
    padded_vocab_size: int
    """Output-layer rows; part of the checkpoint's shape contract."""
    num_microbatches: int
    """Micro-batches of one global batch (the plan's; rampup steps pass fewer)."""
    step_metrics: dict[str, float] = field(default_factory=dict)
    """Extra values of the last training step the log line shows after the lm loss (MoE
    models: Megatron-LM's router losses, e.g. load_balancing_loss), the same on every rank."""

    @abstractmethod
    def forward_backward(self, data: Iterator[Batch] | None, num_microbatches: int | None = None,
                         forward_only: bool = False) -> float:
        """Forward (and backward) over `num_microbatches` (default: the plan's) micro-batches
        read from `data`; returns the global mean token loss, the same on every rank, and
        leaves the gradients finalized in the grad buffers."""

    def sharded_state_dict(self, metadata: dict[str, object]) -> ShardedStateDict:
        """Model state, keyed by global layer index so any plan can load it."""
        # `.module`: DDP has no sharded_state_dict override (megatron/core/distributed/
        # data_parallel_base.py `_BaseDataParallel`): the wrapper would prefix every key.
        merged: ShardedStateDict = {}
        for chunk in self.model:  # chunks' keys are global layer indices: one dict
            merged.update(chunk.module.sharded_state_dict(metadata=metadata))
        return {"model": merged}

    def load_model_state(self, state: StateDict) -> None:
        """Load `state["model"]` (what `sharded_state_dict` keyed) into every chunk."""
        if len(self.model) == 1:
            self.model[0].module.load_state_dict(state["model"], strict=True)
            return
        for chunk in self.model:
            own = chunk.module.state_dict().keys()
            chunk.module.load_state_dict({k: v for k, v in state["model"].items() if k in own},
                                         strict=True)
