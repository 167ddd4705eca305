"""Peak bytes of live tensors, for memory measurements on devices without allocator stats (CPU).

`LiveTensorTracker` is a TorchDispatchMode: every tensor an op produces while it is active has
its storage counted until the storage is freed (weak reference); `register` adds tensors that
existed before (parameters, gradients, optimizer states). The mode is thread-local: tensors
made in other threads are not counted unless `enter_in_this_thread` runs there (the vocabulary
passes' stats callbacks, which may run in a gloo thread, make only [n]-sized ones).
Storages are counted once however many views share them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorTracker(TorchDispatchMode):
    """Counts live tensor storage bytes; `peak_bytes` is the high-water mark since `reset_peak`."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def register(self, tensors: Iterable[torch.Tensor | None]) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes

    def enter_in_this_thread(self) -> None:
        """For a thread's initializer: the mode stays active for the thread's lifetime."""
        self.__enter__()

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        with self._lock:
            if storage in self._seen:
                return
            size = storage.nbytes()
            self._seen[storage] = size
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, size)

    def _release(self, size: int) -> None:
        with self._lock:
            self.live_bytes -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor an optimizer keeps per parameter (Adam: step, exp_avg, exp_avg_sq)."""
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]
