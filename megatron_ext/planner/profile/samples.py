"""Measured samples of a model profile: one transformer-layer shape, one vocabulary shape, one
optimizer step (pure data, JSON readers with one-line PlanErrors). See
megatron_ext/planner/profile/profiles.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_ext.errors import PlanError
from megatron_ext.planner.profile.fit import VOCAB_PHASES
from megatron_ext.schema import (
    expect_object,
    get_bool,
    get_float,
    get_int,
    get_optional_float,
    reject_unknown,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerSample:
    """One measured shape of one transformer layer's TP shard (communication excluded)."""

    tp: int
    """Tensor-parallel degree of the shard."""
    sp: bool
    """Sequence parallelism (norms and dropout on s/tp rows)."""
    micro_batch_size: int
    """Samples of one data-parallel replica (b)."""
    seq_length: int
    """Tokens per sample (s)."""
    forward_s: float
    """Forward seconds."""
    backward_s: float
    """Backward seconds without recomputation."""
    recompute_s: float
    """Extra backward seconds under full recomputation (the forward run again)."""
    selective_recompute_s: float
    """Extra backward seconds under selective (core attention) recomputation."""
    activation_bytes: float | None = None
    """Allocator bytes kept from forward to backward (GPU only; CPU uses the analytic model)."""
    peak_bytes: float | None = None
    """Allocator peak over forward + backward above the weights (GPU only)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, path: str) -> LayerSample:
        data = expect_object(data, path)
        reject_unknown(data, set(cls.__dataclass_fields__), path)
        times = {k: get_float(data, k, path, positive=k in ("forward_s", "backward_s"))
                 for k in ("forward_s", "backward_s", "recompute_s", "selective_recompute_s")}
        for k in ("recompute_s", "selective_recompute_s"):
            if times[k] < 0:
                raise PlanError(f"{path}.{k}={times[k]} must be >= 0")
        return cls(tp=get_int(data, "tp", path, minimum=1), sp=get_bool(data, "sp", path),
                   micro_batch_size=get_int(data, "micro_batch_size", path, minimum=1),
                   seq_length=get_int(data, "seq_length", path, minimum=1), **times,
                   activation_bytes=get_optional_float(data, "activation_bytes", path,
                                                       positive=True),
                   peak_bytes=get_optional_float(data, "peak_bytes", path, positive=True))


@dataclass(frozen=True, kw_only=True, slots=True)
class VocabSample:
    """Vocabulary layers on `tokens` tokens of one replica with the vocabulary split over tp."""

    tp: int
    """Vocabulary shards (output layer rows V/tp)."""
    tokens: int
    """Tokens of one micro-batch of one data-parallel replica."""
    embedding_forward_s: float
    """Embedding lookup forward."""
    embedding_backward_s: float
    """Embedding gradient (scatter-add) backward."""
    output_forward_s: float
    """Output GEMM + vocab-parallel cross-entropy forward (its all-reduces excluded)."""
    output_backward_s: float
    """The same, backward."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, path: str) -> VocabSample:
        data = expect_object(data, path)
        reject_unknown(data, set(cls.__dataclass_fields__), path)
        return cls(tp=get_int(data, "tp", path, minimum=1),
                   tokens=get_int(data, "tokens", path, minimum=1),
                   **{k: get_float(data, k, path, positive=True) for k in VOCAB_PHASES})


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSample:
    """One optimizer step over `num_params` fp32 parameters on one rank."""

    num_params: int
    """Parameters the step updates."""
    step_s: float
    """Seconds of the step."""

    @classmethod
    def from_dict(cls, data: Any, path: str) -> OptimizerSample:
        data = expect_object(data, path)
        reject_unknown(data, {"num_params", "step_s"}, path)
        return cls(num_params=get_int(data, "num_params", path, minimum=1),
                   step_s=get_float(data, "step_s", path, positive=True))
