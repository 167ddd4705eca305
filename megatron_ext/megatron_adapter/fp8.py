"""FP8 at run time: what megatron-core needs to run a plan's FP8Spec, and the one-line refusal
when this machine cannot (before any process group).

megatron-core applies FP8 per layer through `megatron.core.fp8_utils.get_fp8_context`, which
asks `is_first_last_bf16_layer(config, layer_no)` (global zero-based layer index) whether a
layer stays in bf16 (fp8_utils.py:513-530, 596-645 at core_v0.16.1). `install_layer_precision`
replaces that predicate with the plan's FP8Spec.layer_in_fp8, so the per-layer override
(fp8.bf16_layers) reaches weight creation, forward and CUDA graphs the same way Megatron-LM's
first/last window does (the predicate is looked up as a module global at each call).

None of this has run on a GPU: the development machines have neither a GPU nor Transformer
Engine (docs/fp8.md says which parts are checked how).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_ext.errors import PlanError
from megatron_ext.specs import FP8Spec

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

FP8_CAPABILITY = (8, 9)
"""Lowest CUDA compute capability with FP8 tensor cores (Ada sm_89; Hopper is sm_90)."""
MXFP8_CAPABILITY = (10, 0)
"""mxfp8 (block-scaled E8M0) needs Blackwell (sm_100 and later)."""


def check_fp8_runtime(fmt: str | None, recipe: str, *, cpu: bool,
                      transformer_impl: str = "transformer_engine") -> None:
    """One-line PlanError unless this process can train `--fp8-format fmt --fp8-recipe recipe`:
    a CUDA GPU with FP8 tensor cores (Blackwell for mxfp8) and Transformer Engine layers."""
    if fmt is None:
        return
    flags = f"--fp8-format {fmt} --fp8-recipe {recipe}"
    if transformer_impl != "transformer_engine":
        raise PlanError(f"{flags} with --transformer-impl {transformer_impl}: FP8 GEMMs are "
                        "Transformer Engine layers; use --transformer-impl transformer_engine")
    if cpu:
        raise PlanError(f"{flags}: FP8 training needs an NVIDIA GPU with FP8 tensor cores "
                        "(Ada, Hopper or Blackwell) and Transformer Engine; --cpu trains on CPU "
                        "with gloo: drop --fp8-format (or --cpu)")
    from megatron_ext.megatron_adapter.sp_norm import have_transformer_engine

    if not have_transformer_engine():
        raise PlanError(f"{flags}: FP8 GEMMs run in Transformer Engine, which is not installed "
                        "here; install transformer-engine (>= 2.3 for blockwise) or drop "
                        "--fp8-format")
    import torch

    if not torch.cuda.is_available():
        raise PlanError(f"{flags}: no CUDA device is visible; FP8 training needs an NVIDIA GPU "
                        "with FP8 tensor cores")
    major, minor = torch.cuda.get_device_capability()
    need = MXFP8_CAPABILITY if recipe == "mxfp8" else FP8_CAPABILITY
    if (major, minor) < need:
        what = "Blackwell (sm_100+)" if recipe == "mxfp8" else "FP8 tensor cores (sm_89+)"
        raise PlanError(f"{flags}: this GPU ({torch.cuda.get_device_name()}, sm_{major}{minor}) "
                        f"lacks {what}; use another recipe or GPU, or drop --fp8-format")


def install_layer_precision(fp8: FP8Spec | None) -> None:
    """Make megatron-core keep exactly the plan's bf16 layers out of FP8 (see module doc).
    A no-op without FP8 or without per-layer choices beyond Megatron-LM's own window."""
    if fp8 is None or not fp8.bf16_layers:
        return
    from megatron.core import fp8_utils

    def is_bf16_layer(config: TransformerConfig, layer_no: int) -> bool:
        return layer_no >= 0 and not fp8.layer_in_fp8(layer_no, config.num_layers)

    fp8_utils.is_first_last_bf16_layer = is_bf16_layer
