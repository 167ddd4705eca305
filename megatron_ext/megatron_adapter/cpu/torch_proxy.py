"""A module-scoped stand-in for `torch` that turns `device="cuda"` factory literals into CPU.

Used by the `cuda_literals` patch of `cpu_compat`: installing `CpuTorchProxy()` as the global
`torch` of one megatron-core module redirects that module's tensor factories, and nothing else
in the process changes. Functions defined in that module resolve `torch` from their module
globals at call time, so the proxy also covers them when imported by name elsewhere.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FACTORY_NAMES", "CpuTorchProxy", "is_cuda_device"]

FACTORY_NAMES: tuple[str, ...] = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "as_tensor",
)
"""torch factories whose `device=` keyword the proxy rewrites."""


def is_cuda_device(device: Any) -> bool:
    """True for `torch.device("cuda[:i]")`, strings starting with "cuda", and bare int ordinals."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        if is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapper


class CpuTorchProxy(types.ModuleType):
    """Looks like the `torch` module; factories rewrite a CUDA-like `device=` keyword to "cpu".

    Limits: only the `device=` keyword is inspected (every catalogued megatron-core site passes
    it by keyword); positional devices and `.to("cuda")` are not rewritten, and `torch.cuda.*`
    passes straight through (use the `current_device` / `cuda_sync` patches for those).
    """

    def __init__(self) -> None:
        super().__init__("torch", doc=torch.__doc__)
        for name in FACTORY_NAMES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        # Only called for names not in the instance dict, i.e. everything but the factories.
        return getattr(torch, name)

    def __repr__(self) -> str:
        return "<megatron_ext CpuTorchProxy for torch>"
