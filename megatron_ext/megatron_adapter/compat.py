"""The megatron-core calls whose shape differs between the supported versions, bridged in one place.

Each function here is one row of `compat_versions.DIFFERENCES` (feature -> 0.16.1 -> 0.19.x):
the rest of the package calls these and never asks which megatron-core it runs on. Each bridge
detects the feature itself (the name or parameter that changed), not the version number, so a
release between the tested ones (0.17, 0.18) takes whichever shape it has.

Bridges (0.16.1 -> 0.19.x; the full table with file:line is compat_versions.DIFFERENCES):

- `cp_batch`: `utils.get_batch_on_this_cp_rank(batch, cp_group=)` gained a required
  `is_hybrid_cp` (False keeps the same zig-zag split).
- `backward_step`: `schedules.backward_step(in, out, grad, model_type, config)` lost
  `model_type`.
- `write_results_queue`: `filesystem_async._get_write_results_queue()` became
  `get_write_results_queue()`.
- `grads_for_grad_norm`: `MegatronOptimizer.get_main_grads_for_grad_norm()` became
  `get_grads_for_grad_norm()`.
- `moe_metric_values` / `clear_moe_metrics`: `moe_utils.get_moe_layer_wise_logging_tracker()` /
  `clear_aux_losses_tracker()` became deprecated shims over
  `transformer/moe/moe_logging.get_moe_metrics_tracker()`.
- `load_common_state`: a checkpoint's common state moved from `common.pt` into the torch_dist
  files (`common_state`); `load_common_state_dict` reads both on 0.19.
- `router_weighs_the_token_block`: with per-token loss the router weighs each rank's aux and
  z-loss by its tokens (0.16) or by its tokens times the token-block group size (0.19).
- `null_tokenizer`: tokenizer library `"null"` (eod = vocab_size, vocabulary vocab_size + 1)
  became `"null-text"` (eod = vocab_size - 1, vocabulary vocab_size).
- `mla_normalises_query` / `mla_qk_norm_classes`: MLA's norms and projections are resolved by
  `transformer/mla_qk_norm_config.py` on 0.19, which with --qk-layernorm and no q_lora_rank
  also normalises the query in a fused norm+linear `linear_q_proj`; the local spec gets one
  (norm_linear.py).

The batch-size ramp (`RampupBatchsizeNumMicroBatchesCalculator`, removed in 0.19) is computed
by the package on every version (training/rampup.py), so it needs no bridge.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import types
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.pipeline_parallel import schedules
from megatron.core.tokenizers import MegatronTokenizer
from megatron.core.utils import get_batch_on_this_cp_rank

__all__ = ["backward_step", "clear_moe_metrics", "cp_batch", "grads_for_grad_norm",
           "load_common_state", "mla_normalises_query", "mla_qk_norm_classes",
           "moe_metric_values", "null_tokenizer", "router_weighs_the_token_block",
           "write_results_queue"]


@cache
def _parameters(function: Any) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def cp_batch(batch: dict[str, Any], cp_group: torch.distributed.ProcessGroup
             ) -> dict[str, Any]:
    """This context-parallel rank's zig-zag share of every [b, s] tensor of `batch`."""
    if "is_hybrid_cp" in _parameters(get_batch_on_this_cp_rank):  # 0.19
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)  # 0.16


def backward_step(input_tensor: Any, output_tensor: Any, output_tensor_grad: Any,
                  model_type: Any, config: Any) -> Any:
    """megatron-core's pipeline `backward_step`; `model_type` is dropped where it has none."""
    if "model_type" in _parameters(schedules.backward_step):  # 0.16
        return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad,
                                       model_type, config)
    return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)


def write_results_queue() -> Any:
    """The torch_dist checkpoint writer's results queue (its Manager starts on first use)."""
    getter = getattr(filesystem_async, "get_write_results_queue", None)  # 0.19
    if getter is None:
        getter = filesystem_async._get_write_results_queue  # 0.16
    return getter()


@cache
def router_weighs_the_token_block() -> bool:
    """Whether the router itself multiplies a rank's per-token-loss load-balancing and z-loss by
    the token-block group's size (`tp_cp`): 0.19 does (router.py:604-636, "num_local_tokens *
    self.tp_cp_group.size()"), 0.16 weighs them by the rank's own tokens only (router.py:456-494).
    """
    from megatron.core.transformer.moe.router import TopKRouter

    return "tp_cp_group.size()" in inspect.getsource(TopKRouter.attach_and_log_load_balancing_loss)


def load_common_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    """A dist checkpoint's common (non-sharded) state, read on this process alone: `common.pt`
    (0.16's layout, which 0.19 still reads) or, on 0.19+, the torch_dist object `common_state`
    (`load_common_state_dict` reads either). Megatron-LM's checkpoints hold its argparse
    Namespace there, which torch's weights-only loading is told about."""
    path = Path(checkpoint_dir)
    if (path / "common.pt").is_file():
        loaded = torch.load(path / "common.pt", map_location="cpu", weights_only=False)
    else:
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict

        with torch.serialization.safe_globals([argparse.Namespace, types.SimpleNamespace]), \
                warnings.catch_warnings():  # "assuming ... to load in a single process": it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            loaded = load_common_state_dict(str(path))
    if not isinstance(loaded, dict):
        raise TypeError(f"common state is a {type(loaded).__name__}, not a dict")
    return loaded


def grads_for_grad_norm(optimizer: Any) -> list[torch.Tensor]:
    """The gradients an optimizer counts in its grad norm (no shared or TP-duplicate ones)."""
    getter = getattr(optimizer, "get_grads_for_grad_norm", None)  # 0.19
    if getter is None:
        getter = optimizer.get_main_grads_for_grad_norm  # 0.16
    return list(getter())


def _moe_metrics_tracker() -> Any | None:
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # 0.16: the module-level dict in moe_utils
        return None
    return get_moe_metrics_tracker()


def moe_metric_values() -> dict[str, torch.Tensor]:
    """Each router metric saved so far (name -> [num_layers] values, summed over micro-batches)."""
    tracker = _moe_metrics_tracker()
    if tracker is not None:
        return {name: entry.values for name, entry in tracker.metrics.items()}
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return {name: entry["values"] for name, entry in get_moe_layer_wise_logging_tracker().items()}


def clear_moe_metrics() -> None:
    """Forget what the routers saved so far."""
    tracker = _moe_metrics_tracker()
    if tracker is not None:
        tracker.clear()
        return
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def _null_library() -> str:
    from megatron.core.tokenizers import megatron_tokenizer

    text_libraries = getattr(megatron_tokenizer, "TEXT_LIBRARIES", None)  # 0.19
    return "null-text" if text_libraries is not None and "null-text" in text_libraries else "null"


def null_tokenizer(vocab_size: int) -> Any:
    """megatron-core's NullTokenizer for Megatron-LM's `--vocab-size` (the installed version's
    meaning: 0.16 adds the end-of-document id after `vocab_size`, 0.19 makes it the last id)."""
    return MegatronTokenizer.from_pretrained(metadata_path={"library": _null_library()},
                                             vocab_size=vocab_size)


_MLA_QK_NORM_CONFIG = "megatron.core.transformer.mla_qk_norm_config"


@cache
def mla_normalises_query() -> bool:
    """Whether MLA with --qk-layernorm and no q_lora_rank normalises the query: 0.19 does, in a
    fused norm+linear `linear_q_proj` (transformer/mla_qk_norm_config.py:132-167); 0.16 builds
    no query norm without a query latent (multi_latent_attention.py:497)."""
    return importlib.util.find_spec(_MLA_QK_NORM_CONFIG) is not None


def mla_qk_norm_classes(config: Any, submodules: Any, fused_norm_linear: type) -> dict[str, Any]:
    """0.19's resolution of MLA's q/kv norms and up projections (QKNormConfigResolver) for a
    local-spec layer, with `fused_norm_linear` as the fused norm+linear: the resolver takes it
    from `config.transformer_impl`'s backend, which is None on the local one
    (models/backends.py:114) and Transformer Engine's class by default, and would refuse or
    substitute the spec's `linear_q_proj` (mla_qk_norm_config.py:234-238)."""
    resolver = importlib.import_module(_MLA_QK_NORM_CONFIG).QKNormConfigResolver(config,
                                                                                  submodules)
    resolver.fused_norm_linear_impl = fused_norm_linear
    return resolver.resolve()
