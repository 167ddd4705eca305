"""Keep freed host memory mapped in CPU ranks, as the CUDA caching allocator keeps device memory.

A training step on the CPU allocates its activations, gradients and logits through glibc's
malloc. By default glibc returns large blocks to the kernel when they are freed (blocks above
its mmap threshold, up to 32 MiB, are mmap'd and unmapped each time; the top of the heap is
trimmed above the trim threshold), so the next step touches fresh pages again: one page fault
and one zeroed page per 4 KiB. On the 2-core test machine a 4-rank step of the calibration
model (micro-batch 32, pipeline 4) took 26-44 thousand page faults per rank and 2.16 s; with the
memory kept mapped, ~100 faults and 1.68 s (tools/bench_costmodel.py --pieces,
docs/benchmarks.md). A profiler loop that runs one layer again and again reuses the same warm
blocks, so it never sees that cost, and neither does a GPU, whose caching allocator keeps the
blocks it frees.

`keep_freed_memory_mapped` sets glibc's thresholds (mallopt) so that freed blocks stay in the
process for the next step: every rank of a CPU run, the model profiler's workers and the test
ranks call it, so what is profiled and what is trained allocate alike. Memory that a step
frees is then reused, not returned; a process's resident size stays at its peak. A no-op
outside glibc (musl, macOS) and when MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ are set
in the environment (the user's choice wins).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["keep_freed_memory_mapped"]

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter numbers (malloc.h)."""
MMAP_THRESHOLD_BYTES = 2**30
"""Blocks below this come from the heap (glibc's dynamic threshold stops at 32 MiB; a logits
tensor of 4096 tokens x 2048 vocabulary in fp32 is already 32 MiB)."""
TRIM_THRESHOLD_BYTES = 2**31 - 1
"""Never trim the top of the heap during a run (mallopt takes an int: its largest value)."""

_done = False


def keep_freed_memory_mapped() -> bool:
    """Set the thresholds once per process; True when they are set (now or before)."""
    global _done
    if _done:
        return True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _done
