"""Measured NCCL all-reduce times inside one node, for the GPU presets that have a public
measurement (nccl_a100.json: nccl-tests on 2-8 A100 of one NVSwitch node).

NCCL's tuning constants (comm.AlphaBetaComm) are what NCCL uses to choose an algorithm, not what
a call takes: on A100 they put an all-reduce of 1-32 MiB, the size of a tensor-parallel block's
activations, at 0.4-0.9x its measured time (2 GPUs: 8 MiB measured 87 us, the formula 52 us;
busbw 96 against 230 GB/s), and large ones at 0.86-1.0x. Where a table exists, an all-reduce
of p ranks inside the node takes its measured time, interpolated log-log between the measured
sizes; below the smallest size the formula scaled to meet it there, above the largest the
largest size's bandwidth. A ring all-gather or reduce-scatter of N bytes (comm.py's convention:
the gathered output, the full input) is half an all-reduce of N: p - 1 of its 2 (p - 1) steps
over the same bytes per step.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

ArrayLike = float | np.ndarray

TABLES = {"dgx-a100-40g": "nccl_a100.json", "dgx-a100-80g": "nccl_a100.json"}
"""GPU preset -> its measured table (next to this module)."""
PRESET_NVLINK = (230e9, 3.4e-6)
"""The A100 presets' NVLink link (bus bandwidth, hop latency): a cluster that kept the preset's
name but states its own intra-node link is priced by the formula on that link, not by the
table."""
HALF_ALL_REDUCE = ("all_gather", "reduce_scatter")


@functools.lru_cache(maxsize=4)
def _load(filename: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{group size: (bytes, in-place seconds)} from a table's verbatim nccl-tests lines."""
    data = json.loads(Path(__file__).with_name(filename).read_text())
    out = {}
    for p, lines in data["lines"].items():
        cells = [line.split(",") for line in lines]
        out[int(p)] = (np.array([float(c[0]) for c in cells]),
                       np.array([float(c[5]) * 1e-9 for c in cells]))
    return out


def table_for(cluster_name: str, intra_link: tuple[float, float], group_size: int
              ) -> tuple[np.ndarray, np.ndarray] | None:
    """(bytes, seconds) of the measured all-reduce of `group_size` ranks inside one node of
    the preset `cluster_name` whose intra-node link is (bus bandwidth, hop latency)
    `intra_link`, or None where none was measured."""
    filename = TABLES.get(cluster_name)
    if filename is None or intra_link != PRESET_NVLINK:
        return None
    return _load(filename).get(group_size)


def measured_time_s(table: tuple[np.ndarray, np.ndarray], collective: str,
                    num_bytes: ArrayLike, formula: Callable[[ArrayLike], ArrayLike]
                    ) -> ArrayLike:
    """Seconds of `collective` (all_reduce, all_gather, reduce_scatter) on `num_bytes` from a
    measured all-reduce table; `formula(bytes)` is the formula's time of the same collective,
    scaled below the table to meet it at its smallest size (module docstring)."""
    sizes, seconds = table
    half = 0.5 if collective in HALF_ALL_REDUCE else 1.0
    n = np.asarray(num_bytes, dtype=float)
    inside = np.exp(np.interp(np.log(np.clip(n, sizes[0], sizes[-1])), np.log(sizes),
                              np.log(seconds)))
    above = seconds[-1] * n / sizes[-1]
    out = half * np.where(n > sizes[-1], above, inside)
    if np.any(n < sizes[0]):
        scale = half * seconds[0] / float(formula(float(sizes[0])))
        out = np.where(n < sizes[0], np.asarray(formula(n), dtype=float) * scale, out)
    return out if out.ndim else float(out)
