"""Third-party warnings with nothing for a user to do, filtered once per process at their source.

`install()` puts one `warnings.filterwarnings("ignore", ...)` per entry below. It runs before any
megatron-core import: `megatron_ext.megatron_adapter` (the only package that imports megatron)
calls it when it is imported, and every entry point calls it first (the `megatron-ext` CLI,
examples/pretrain_gpt.py via training/entry.py, tools/*.py), so no entry can import megatron-core
before it. Each filter matches one message of one category; anything else still shows.
pytest.ini filters the import-time ones for the tests (tests/unit/test_console.py checks that
this list covers them). Imports neither torch nor megatron.
"""

from __future__ import annotations

import warnings

# (message regex, category)
KNOWN_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # megatron-core without Transformer Engine / Apex (CPU builds): it falls back and says so.
    ("Apex is not installed", UserWarning),
    ("Transformer Engine and Apex are not installed", UserWarning),
    # megatron-core 0.16.1 internals.
    ("full scope is deprecated", UserWarning),
    # megatron-core 0.19 (hyper_comm_grid.py:21): optional absl-py, it falls back to logging.
    ("absl.logging is not installed", UserWarning),
    # advice for transformer-engine's fused attention, given whenever core_attn is recomputed
    # (transformer_config.py:1225), also with the local layers
    ("If you are using transformer_engine as the transformer implementation, the core_attn",
     UserWarning),
    ("`torch.jit.script_method` is deprecated", DeprecationWarning),
    ("The following imports from `dynamic_context.py`", DeprecationWarning),
    ("The 'megatron.core.transformer.custom_layers.transformer_engine'", DeprecationWarning),
    # megatron-core's DDP calls torch's old collective names.
    (r"`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning),
    (r"`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning),
    # megatron-core's checkpoint loader calls torch.distributed.checkpoint's old name
    # (dist_checkpointing/strategies/torch.py:799), on every load.
    ("`load_state_dict` is deprecated and will be removed in future versions", FutureWarning),
    # megatron-core's optimizer probes `.grad` of its fp32 views (optimizer.py:66).
    ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning),
)

# Advice that only applies on GPUs: filtered when training on CPU (--cpu).
CPU_ONLY_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    ("When using async grad allreduce it is recommended to set the environment variable "
     "CUDA_DEVICE_MAX_CONNECTIONS", UserWarning),
    ("When using sequence parallelism it is recommended to set the environment variable "
     "CUDA_DEVICE_MAX_CONNECTIONS", UserWarning),
)

def install(*, cpu: bool = False) -> None:
    """Filter KNOWN_WARNINGS (and CPU_ONLY_WARNINGS with `cpu`). Calling it again adds nothing:
    `warnings.filterwarnings` replaces an identical filter instead of adding a second one."""
    for message, category in KNOWN_WARNINGS + (CPU_ONLY_WARNINGS if cpu else ()):
        warnings.filterwarnings("ignore", message=message, category=category)
