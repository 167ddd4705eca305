"""Measured model-state memory of one rank: bytes of parameters, gradients and optimizer states
held right now, per gradient class of `HeteroDDP` (what the cost model's
`state_bytes_per_param` predicts per ZeRO level).

Counts live storages, each once (megatron's DDP buffers hold a class's parameters and
gradients as views of one flat buffer, padding included; FSDP2 frees a re-sharded layer's
gathered storage by resizing it to zero, so a gathered ZeRO-2 layer counts its full weights
only while they are alive). Call it where the peak sits, e.g. after the forward of the last
micro-batch (ZeRO-2 weights gathered, earlier micro-batches' gradients held) of a step after
the first (optimizer states exist).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["class_state_bytes"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _storage_bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def class_state_bytes(chunk: torch.nn.Module, optimizer: torch.nn.Module) -> list[dict]:
    """Per gradient class of `chunk` (a HeteroDDP): its zero level, tp, the modules it holds and
    bytes of parameters / gradients / optimizer states on this rank. `optimizer` is
    `build_optimizer`'s chain (one sub-optimizer per class, in class order)."""
    out = []
    for cls, ddp, opt in zip(chunk.classes, chunk.ddps, optimizer.chained_optimizers):
        seen: set[int] = set()
        module_params = list(ddp.module.parameters())  # gathered ones while a layer is unsharded
        opt_params = [p for group in opt.optimizer.param_groups for p in group["params"]]
        params = _storage_bytes(module_params + opt_params, seen)
        grads = _storage_bytes([g for p in module_params + opt_params
                                for g in (getattr(p, "main_grad", None), p.grad)
                                if g is not None], seen)
        states = _storage_bytes([t for state in opt.optimizer.state.values()
                                 for t in state.values() if torch.is_tensor(t)], seen)
        out.append({"tp": cls.tp, "zero": cls.zero, "modules": [type(m).__name__
                                                                 for m in cls.modules],
                    "param_bytes": params, "grad_bytes": grads, "optimizer_bytes": states,
                    "numel": sum(p.numel() for m in cls.modules for p in m.parameters())})
    return out
