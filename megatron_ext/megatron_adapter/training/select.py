"""Which backend runs a plan: stock megatron-core, the layerwise runtime, or FlexSP."""

from __future__ import annotations

import argparse

from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter.training.backend import Backend
from megatron_ext.megatron_adapter.training.flexsp_backend import build_flexsp_backend
from megatron_ext.megatron_adapter.training.runtime_backend import build_runtime_backend
from megatron_ext.megatron_adapter.training.stock_backend import (
    build_stock_backend,
    stock_unsupported_reason,
)
from megatron_ext.plan import ParallelPlan


def build_backend(args: argparse.Namespace, plan: ParallelPlan, padded_vocab: int, *,
                  model_format: str | None = None, eod: int | None = None) -> Backend:
    """The stock backend when megatron-core can express the plan, else the layerwise runtime.

    `model_format` is the format of the checkpoint to be loaded: a "layerwise" checkpoint is
    resumed by the layerwise runtime even under a uniform plan; a "megatron" one cannot be
    loaded by the runtime yet (the two key layouts differ). `eod` (the tokenizer's end-of-
    document id) is needed by FlexSP plans, which cut samples into documents.
    """
    reason = stock_unsupported_reason(plan)
    if plan.flexsp is not None:  # its checkpoints use GPTModel's keys: any format but layerwise
        if model_format == "layerwise":
            raise PlanError("--load holds a layerwise-runtime checkpoint; a FlexSP plan loads "
                            "only stock (megatron) checkpoints")
        assert eod is not None, "FlexSP plans need the tokenizer's eod id"
        return build_flexsp_backend(args, plan, padded_vocab, eod)
    if reason is None and model_format != "layerwise":
        return build_stock_backend(args, plan, padded_vocab)
    if reason is not None and model_format == "megatron":
        raise PlanError(f"--load holds a checkpoint of a uniform (stock megatron-core) plan, "
                        f"but this plan needs the layerwise runtime ({reason}), whose checkpoint "
                        "layout differs; start from a uniform plan, or convert is not supported "
                        "yet")
    return build_runtime_backend(args, plan, padded_vocab)
