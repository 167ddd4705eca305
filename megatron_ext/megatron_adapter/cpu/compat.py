"""Run megatron-core 0.16.1-0.19.x on CPU-only torch under gloo: thirteen named, opt-in, undoable
patches (the MoE ones for Mixture-of-Experts layers), each for the megatron-core versions it
names (`CompatPatch.versions`; te_gemm_stub is 0.16-only: 0.19 fixed it upstream).

Each CUDA hard-code met on the CPU/gloo path is handled by one named patch; its builder's
docstring names the megatron-core 0.16.1 `file:line` sites (paths relative to megatron/core/)
it addresses. The catalogue, the verified minimal sets and the reasoning are in
`patches/README.md`.

Usage (order matters for the module-attribute patches `causal_mask` and `rng`)::

    dist.init_process_group("gloo")
    from megatron_ext.megatron_adapter.cpu import compat as cpu_compat
    cpu_compat.apply()                       # no-op when torch.cuda.is_available()
    parallel_state.initialize_model_parallel(...)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)   # call through the module
    ... build GPTModel / DDP / optimizer ...

Mechanics: a patch is a builder returning `(owner, attr, replacement)` targets. Installing
stamps the replacement with `SENTINEL` (the patch name) and `ORIGINAL` (what it replaced).
An attribute that already carries the sentinel is left alone, so re-applying after a reload of
this module never nests wrappers, and `undo()` restores originals from the stamped objects,
even ones installed by an earlier copy of this module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from megatron_ext.megatron_adapter.cpu.patches import (
    CUDA_LITERAL_MODULES,
    ORIGINAL,
    PATCHES,
    SENTINEL,
    CompatPatch,
    current_value,
    is_patched,
    restore,
)

__all__ = [
    "CUDA_LITERAL_MODULES",
    "PATCHES",
    "CompatPatch",
    "applied",
    "apply",
    "for_version",
    "megatron_core_version",
    "is_patched",
    "undo",
]

logger = logging.getLogger(__name__)

_APPLIED: list[str] = []


def megatron_core_version() -> str:
    """The version of the megatron-core this process imports."""
    from megatron.core import package_info

    return str(package_info.__version__)


def for_version(version: str | None = None) -> tuple[str, ...]:
    """The patches megatron-core `version` (default: the imported one) needs, in order."""
    version = megatron_core_version() if version is None else version
    return tuple(name for name, patch in PATCHES.items() if patch.applies_to(version))


def _select(names: Iterable[str] | None, exclude: Iterable[str]) -> list[str]:
    chosen = list(PATCHES) if names is None else list(names)
    excluded = set(exclude)
    unknown = sorted((set(chosen) | excluded) - set(PATCHES))
    if unknown:
        raise ValueError(f"unknown cpu_compat patch(es) {unknown}; known: {list(PATCHES)}")
    return [name for name in chosen if name not in excluded]


def _install(name: str) -> None:
    patch = PATCHES[name]
    for owner, attr, replacement in patch.build():
        if is_patched(owner, attr):  # installed before (e.g. by a reloaded copy): never nest
            continue
        setattr(replacement, SENTINEL, name)
        setattr(replacement, ORIGINAL, current_value(owner, attr))
        setattr(owner, attr, replacement)
    if patch.on_apply is not None:
        patch.on_apply()


def apply(
    names: Iterable[str] | None = None, *, force: bool = False, exclude: Iterable[str] = ()
) -> tuple[str, ...]:
    """Apply the named patches (all by default, minus `exclude`); returns the newly applied names.

    Does nothing when `torch.cuda.is_available()` unless `force=True`. Patches not for the
    imported megatron-core (`CompatPatch.versions`) are skipped, named or not. Idempotent: names
    already applied in this process are skipped. Apply after importing megatron.core and before
    `initialize_model_parallel` / `model_parallel_cuda_manual_seed` / model construction.
    Raises ValueError for unknown names.
    """
    selected = _select(names, exclude)
    if torch.cuda.is_available() and not force:
        return ()
    wanted = for_version()
    newly_applied = []
    for name in selected:
        if name in _APPLIED or name not in wanted:
            continue
        _install(name)
        _APPLIED.append(name)
        newly_applied.append(name)
    if newly_applied:
        logger.debug("cpu_compat applied %s", newly_applied)
    return tuple(newly_applied)


def undo(names: Iterable[str] | None = None) -> tuple[str, ...]:
    """Restore the originals of the named patches (all by default); returns the names undone.

    Works from the stamped replacements, so it also removes patches installed by an earlier
    (reloaded) copy of this module. Patches not currently installed are skipped.
    """
    selected = _select(names, ())
    undone = []
    for name in reversed(selected):
        patch = PATCHES[name]
        restored = False
        for owner, attr, _ in patch.build():
            current = current_value(owner, attr)
            if getattr(current, SENTINEL, None) == name:
                restore(owner, attr, getattr(current, ORIGINAL))
                restored = True
        if patch.on_undo is not None:
            patch.on_undo()
        if name in _APPLIED:
            _APPLIED.remove(name)
            restored = True
        if restored:
            undone.append(name)
    return tuple(undone)


def applied() -> tuple[str, ...]:
    """Names applied in this process, in application order."""
    return tuple(_APPLIED)
