"""A norm followed by megatron-core's ColumnParallelLinear, for the local (no TE) spec.

Legend: s = sequence, b = micro-batch, h = input width, n = output width, tp = size of tp_group.

megatron-core 0.19 resolves MLA's projections in transformer/mla_qk_norm_config.py: with
`qk_layernorm` and no `q_lora_rank` it normalises the query too, inside a fused norm+linear
`linear_q_proj` (:132-167) that only Transformer Engine provides (`TELayerNormColumnParallelLinear`;
the local backend's `column_parallel_layer_norm_linear()` is None, models/backends.py:114).
`LocalLayerNormColumnParallelLinear` is that module on the local spec: the configured norm
(RMSNorm or LayerNorm, as torch computes them for the local spec's norms) and then
ColumnParallelLinear, with TE's constructor and `(output, bias)` forward and TE's parameter names
(`layer_norm_weight`, `layer_norm_bias`), so a checkpoint names them as megatron-core does.

Under sequence parallelism the norm runs on the `[s/tp, b, h]` shard before the linear's
all-gather, so its weights carry `sequence_parallel` like every other norm (summed over TP by
finalize_model_grads); without it the linear's input-gradient all-reduce makes them complete.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

__all__ = ["LocalLayerNormColumnParallelLinear"]


class LocalLayerNormColumnParallelLinear(ColumnParallelLinear):
    """`config.normalization` over the last dim, then ColumnParallelLinear (no Transformer Engine).

    Constructor and forward as TELayerNormColumnParallelLinear's
    (extensions/transformer_engine.py); forward returns `(output, bias)`.
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any,
                 init_method: Callable, gather_output: bool, bias: bool, skip_bias_add: bool,
                 is_expert: bool, skip_weight_param_allocation: bool = False,
                 tp_comm_buffer_name: str | None = None, tp_group: Any = None, stride: int = 1,
                 name: str | None = None) -> None:
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {config.normalization!r}: the local norm+linear "
                             "supports LayerNorm and RMSNorm")
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma needs Transformer Engine's "
                             "norm+linear")
        extra = {"name": name} if "name" in inspect.signature(super().__init__).parameters else {}
        super().__init__(input_size, output_size, config=config, init_method=init_method,
                         bias=bias, gather_output=gather_output, stride=stride,
                         skip_bias_add=skip_bias_add,
                         skip_weight_param_allocation=skip_weight_param_allocation,
                         is_expert=is_expert, tp_comm_buffer_name=tp_comm_buffer_name,
                         tp_group=tp_group, **extra)
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        # beside the linear's own weight (megatron-core placed it: CPU or the current device)
        device = (self.weight.device if self.weight is not None else
                  torch.device("cpu") if config.use_cpu_initialization else None)
        factory = {"device": device, "dtype": config.params_dtype}
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, **factory))
        self.layer_norm_bias = (torch.nn.Parameter(torch.zeros(input_size, **factory))
                                if self.normalization == "LayerNorm" else None)
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            if param is not None:
                param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        shape = (input_.shape[-1],)
        if self.normalization == "RMSNorm":
            normed = F.rms_norm(input_, shape, self.layer_norm_weight, self.eps)  # [s(/tp), b, h]
        else:
            normed = F.layer_norm(input_, shape, self.layer_norm_weight, self.layer_norm_bias,
                                  self.eps)  # [s(/tp), b, h]
        return super().forward(normed, weight=weight,  # [s, b, n/tp]
                               runtime_gather_output=runtime_gather_output)
