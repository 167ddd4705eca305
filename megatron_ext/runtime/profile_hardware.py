"""Hardware profiler: collective curves, overlap slowdown and per-rank peak -> ClusterProfile.

Legend: W = world size, L = ranks per node, g = group size, n = message bytes (convention of
megatron_ext/planner/profile/profiles.py: all_reduce the buffer, all_gather the gathered output,
reduce_scatter
the full input, all_to_all one rank's send buffer, p2p the message).

Every rank calls every function here (they are collective over `world`). For each power-of-two
g and each placement, adjacent ([0..g), [g..2g), ...) and strided (members W/g apart, i.e.
spread over the nodes), all W/g disjoint groups run the collective at once, as data-parallel and
tensor-parallel groups do in training; one sample is the slowest rank's time. Timing: CUDA events
on GPU, wall clock after a barrier on CPU; after `warmup`, a collective's time is the median
of `repeats` samples: a training step pays each of its collectives' typical time, not the
luckiest (on 4 ranks sharing 2 cores a small all-gather's fastest sample is the one in which
every rank happened to be running, ~half its median: plans whose tensor-parallel group spans
all 4 ranks came out 16-18% fast, tools/bench_costmodel.py --pieces in docs/benchmarks.md;
on GPUs the two are close, as nccl-tests' averages show). Compute rates (peak, overlap,
slots) keep the fastest sample, as the model profiler does. The peak is one rank's matmul rate
alone; compute slots say how many ranks of a node compute at that rate at once. Collectives are
timed alone also when ranks share compute (CPU cores): a rank waiting in a collective for one the
scheduler has not run yet leaves its core to that rank, so the wait is compute the shared-compute
model (planner/profile/pipeline.py) already counts, not communication. (Timing each collective
after a burst of compute, minus the burst, counted it twice: tensor-parallel plans came out
25-94% slow in tools/bench_costmodel.py, see docs/benchmarks.md.)
Groups are passed explicitly and the device is taken from the tensors.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_ext.planner.profile.profiles import (
    ClusterProfile,
    CollectiveCurve,
    fitted_link,
)
from megatron_ext.specs import ClusterSpec

__all__ = ["measure_seconds", "message_sizes", "placement", "profile_collective",
           "profile_hardware", "profile_overlap", "profile_peak_flops"]

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# torch >= 2.13 renamed the tensor collectives (the old names warn); same arguments
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_MIN_SECONDS = 1e-7
"""Floor of a collective's time (a timer can read 0 for the smallest messages)."""


def measure_seconds(fn: Callable[[], object], *, world: dist.ProcessGroup, device: torch.device,
                    repeats: int, warmup: int = 2, typical: bool = False) -> float:
    """Fastest over `repeats` of the slowest rank's seconds for `fn()` (collective over world);
    with `typical`, their median (the upper median for an even count)."""
    for _ in range(warmup):
        fn()
    samples = torch.zeros(repeats, dtype=torch.float64, device=device)  # [repeats]
    for i in range(repeats):
        dist.barrier(group=world)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples[i] = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            samples[i] = time.perf_counter() - t0
    dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=world)
    ordered = sorted(samples.tolist())
    return ordered[len(ordered) // 2] if typical else ordered[0]


def placement(world_size: int, group_size: int, strided: bool) -> list[list[int]]:
    """The W/g disjoint groups: adjacent blocks, or members W/g ranks apart."""
    n = world_size // group_size
    if strided:
        return [[r + j * n for j in range(group_size)] for r in range(n)]
    return [list(range(i * group_size, (i + 1) * group_size)) for i in range(n)]


def _ranks_per_node(members: list[int], local_world_size: int) -> int:
    nodes = [r // local_world_size for r in members]
    return max(nodes.count(node) for node in set(nodes))


def _numel(num_bytes: int, dtype: torch.dtype) -> int:
    return max(1, num_bytes // torch.empty(0, dtype=dtype).element_size())


def _collective_fn(op: str, num_bytes: int, group: dist.ProcessGroup, device: torch.device,
                   dtype: torch.dtype) -> Callable[[], object]:
    g = dist.get_world_size(group)
    numel = max(g, _numel(num_bytes, dtype) // g * g)
    full = torch.ones(numel, dtype=dtype, device=device)  # [n]
    shard = torch.ones(numel // g, dtype=dtype, device=device)  # [n/g]
    other = torch.empty_like(full)  # [n]
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: _ALL_GATHER(full, shard, group=group)  # [n/g] -> [n]
    if op == "reduce_scatter":
        return lambda: _REDUCE_SCATTER(shard, full, group=group)  # [n] -> [n/g]
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(other, full, group=group)  # [n] -> [n]
    raise ValueError(f"unknown collective {op!r}")


def _ping_pong_fn(members: list[int], num_bytes: int, group: dist.ProcessGroup,
                  device: torch.device, dtype: torch.dtype) -> Callable[[], object]:
    """First member sends n bytes, second sends them back: two one-way messages."""
    buf = torch.ones(_numel(num_bytes, dtype), dtype=dtype, device=device)
    first = dist.get_rank() == members[0]
    peer = members[1] if first else members[0]

    def run() -> None:
        if first:
            dist.send(buf, dst=peer, group=group)
            dist.recv(buf, src=peer, group=group)
        else:
            dist.recv(buf, src=peer, group=group)
            dist.send(buf, dst=peer, group=group)
    return run


def profile_collective(op: str, groups: list[list[int]], handles: list[dist.ProcessGroup], *,
                       sizes: list[int], local_world_size: int, world: dist.ProcessGroup,
                       device: torch.device, dtype: torch.dtype, repeats: int
                       ) -> CollectiveCurve:
    """One curve: every group of the placement runs `op` at once, for each size."""
    rank = dist.get_rank()
    mine = next(i for i, members in enumerate(groups) if rank in members)
    seconds = []
    for num_bytes in sizes:
        if op == "p2p":
            fn = _ping_pong_fn(groups[mine], num_bytes, handles[mine], device, dtype)
        else:
            fn = _collective_fn(op, num_bytes, handles[mine], device, dtype)
        t = max(measure_seconds(fn, world=world, device=device, repeats=repeats, typical=True),
                _MIN_SECONDS)
        seconds.append(t / 2 if op == "p2p" else t)
    g = len(groups[0])
    stride = groups[0][1] - groups[0][0]
    return CollectiveCurve(collective=op, group_size=g, stride=stride,
                           ranks_per_node=_ranks_per_node(groups[0], local_world_size),
                           num_bytes=tuple(float(s) for s in sizes), seconds=tuple(seconds))


def _matmul_fn(dim: int, count: int, device: torch.device, dtype: torch.dtype
               ) -> Callable[[], object]:
    a = torch.randn(dim, dim, device=device).to(dtype)  # [d, d]
    b = torch.randn(dim, dim, device=device).to(dtype)  # [d, d]

    def run() -> None:
        for _ in range(count):
            torch.mm(a, b)
    return run


def profile_peak_flops(*, world: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                       dim: int, repeats: int, local_world_size: int,
                       min_duration_s: float = 0.2) -> tuple[float, float]:
    """(matmul FLOP/s of one rank computing alone, compute slots per node).

    Slots = L * T(first rank of each node alone) / T(all L at once), in [1, L]: how many ranks
    of a node compute at full speed together (L with one GPU per rank; about the cores when
    ranks share a CPU, never more than the cores this process may run on). Each timed run
    lasts >= min_duration_s, so the ranks' start skew after the barrier does not count."""
    one = measure_seconds(_matmul_fn(dim, 1, device, dtype), world=world, device=device,
                          repeats=repeats)
    count = torch.tensor([max(1, math.ceil(min_duration_s / one))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=world)  # same work on every rank
    busy = _matmul_fn(dim, int(count), device, dtype)
    t_all = measure_seconds(busy, world=world, device=device, repeats=repeats)
    alone = dist.get_rank() % local_world_size == 0
    t_one = measure_seconds(busy if alone else (lambda: None), world=world, device=device,
                            repeats=repeats)
    cap = local_world_size
    if device.type == "cpu" and hasattr(os, "sched_getaffinity"):
        cap = min(cap, len(os.sched_getaffinity(0)))
    slots = min(float(cap), max(1.0, local_world_size * t_one / t_all))
    return int(count) * 2.0 * dim**3 / t_one, slots


def profile_overlap(*, world: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                    num_bytes: int, dim: int, repeats: int) -> tuple[float, dict[str, float]]:
    """max(1, T(all_reduce beside matmuls) / max(T(all_reduce), T(matmuls))), with as many
    matmuls as take about as long as the all-reduce alone."""
    comm = _collective_fn("all_reduce", num_bytes, world, device, dtype)
    t_comm = measure_seconds(comm, world=world, device=device, repeats=repeats)
    t_one = measure_seconds(_matmul_fn(dim, 1, device, dtype), world=world, device=device,
                            repeats=repeats)
    count = max(1, round(t_comm / t_one))
    compute = _matmul_fn(dim, count, device, dtype)
    t_comp = measure_seconds(compute, world=world, device=device, repeats=repeats)
    buf = torch.ones(_numel(num_bytes, dtype), dtype=dtype, device=device)

    def both() -> None:
        work = dist.all_reduce(buf, group=world, async_op=True)
        compute()
        work.wait()
    t_both = measure_seconds(both, world=world, device=device, repeats=repeats)
    raw = {"comm_s": t_comm, "compute_s": t_comp, "both_s": t_both, "matmuls": float(count)}
    return max(1.0, t_both / max(t_comm, t_comp)), raw


def profile_comm_cpu_share(*, world: dist.ProcessGroup, device: torch.device,
                           dtype: torch.dtype, sizes: list[int], local_world_size: int,
                           slots: float, repeats: int) -> float:
    """Share of a node's compute slots its ranks' collectives keep busy while they run: the
    CPU seconds the node's ranks spend in them (all threads: the backend's own included), over
    wall seconds x `slots`; median over the collectives and sizes, every node's ranks in one
    group as a tensor-parallel group is, all nodes at once (summed over the world, so every rank
    gets the same figure). On a GPU 0: NCCL moves the data with
    the GPU's own engines, and its share of the SMs is in the overlap slowdown. On CPU ranks
    a transfer is CPU work, so a collective that runs beside compute takes this share of the
    cores from it (planner/profile/cost.py)."""
    if device.type != "cpu":
        return 0.0
    members = placement(dist.get_world_size(world), local_world_size, False)
    handles = [dist.new_group(m) for m in members]  # every rank, same order
    mine = handles[dist.get_rank() // local_world_size]
    shares = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for num_bytes in sizes[:: max(1, len(sizes) // 4)]:
            fn = _collective_fn(op, num_bytes, mine, device, dtype)
            fn()
            dist.barrier(group=world)
            cpu0, t0 = time.process_time(), time.perf_counter()
            for _ in range(repeats):
                fn()
            sample = torch.tensor([time.process_time() - cpu0, time.perf_counter() - t0],
                                  dtype=torch.float64)
            cpu = sample[:1].clone()
            dist.all_reduce(cpu, group=world)  # CPU seconds of every rank
            wall = sample[1:].clone()
            dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=world)
            shares.append(min(1.0, float(cpu) / (float(wall) * slots * len(members))))
    return float(statistics.median(shares))


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """min, min * factor, ... below max, then max: at least two sizes."""
    if not 1 <= min_bytes < max_bytes:
        raise ValueError(f"message sizes need 1 <= min_bytes < max_bytes, got {min_bytes} and "
                         f"{max_bytes}")
    sizes, n = [], min_bytes
    while n < max_bytes:
        sizes.append(n)
        n *= factor
    return sizes + [max_bytes]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def _memory_gib(device: torch.device, local_world_size: int) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    import psutil

    return psutil.virtual_memory().total / 2**30 / local_world_size


def profile_hardware(*, world: dist.ProcessGroup, device: torch.device,
                     local_world_size: int | None = None, min_bytes: int | None = None,
                     max_bytes: int | None = None, repeats: int | None = None,
                     dtype: torch.dtype | None = None,
                     progress: Callable[[str], None] | None = None,
                     nvlink_domain_size: int = 0) -> ClusterProfile:
    """Measure every curve, the overlap slowdown and the peak; same result on every rank.
    `nvlink_domain_size` (GPUs on one NVLink fabric; 0: one node) is recorded as given: NCCL
    exposes no fabric size, and the curves it measures stop at the job's own GPUs."""
    gpu = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if gpu else torch.float32)
    repeats = repeats if repeats is not None else (10 if gpu else 5)
    sizes = message_sizes(min_bytes if min_bytes is not None else (2**16 if gpu else 2**12),
                          max_bytes if max_bytes is not None else (2**30 if gpu else 2**24))
    world_size = dist.get_world_size(world)
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if repeats < 1 or local < 1 or world_size % local:
        raise ValueError(f"need repeats >= 1 (got {repeats}) and a world size ({world_size}) "
                         f"that is a multiple of the ranks per node ({local})")
    mm_dim = 4096 if gpu else 256
    peak, slots = profile_peak_flops(world=world, device=device, dtype=dtype, dim=mm_dim,
                                     repeats=repeats, local_world_size=local)
    curves = _all_curves(sizes, world_size, local, world=world, device=device, dtype=dtype,
                         repeats=repeats, progress=progress)
    slowdown, _ = profile_overlap(world=world, device=device, dtype=dtype, num_bytes=sizes[-1],
                                  dim=mm_dim, repeats=repeats)
    cpu_share = profile_comm_cpu_share(world=world, device=device, dtype=dtype, sizes=sizes,
                                       local_world_size=local, slots=slots, repeats=repeats)
    ar = [c for c in curves if c.collective == "all_reduce"]
    intra = fitted_link([c for c in ar if not c.crosses_nodes])
    inter = fitted_link([c for c in ar if c.crosses_nodes]) or intra
    cluster = ClusterSpec(name=f"measured-{dist.get_backend(world)}", num_nodes=world_size // local,
                          gpus_per_node=local, memory_gib=round(_memory_gib(device, local), 3),
                          peak_flops=peak, nvlink_domain_size=nvlink_domain_size)
    if intra is not None:  # else ClusterSpec's default links
        cluster = dataclasses.replace(cluster, intra_node=intra, inter_node=inter or intra)
    return ClusterProfile(cluster=cluster, backend=str(dist.get_backend(world)),
                          device=_device_name(device), overlap_slowdown=slowdown,
                          compute_slots_per_node=round(slots, 3),
                          comm_cpu_share=round(cpu_share, 3),
                          collectives=tuple(curves))


def _all_curves(sizes: list[int], world_size: int, local: int, *, world: dist.ProcessGroup,
                device: torch.device, dtype: torch.dtype, repeats: int,
                progress: Callable[[str], None] | None) -> list[CollectiveCurve]:
    curves = []
    g = 2
    while g <= world_size:
        seen: list[list[list[int]]] = []
        for strided in (False, True):
            groups = placement(world_size, g, strided)
            if groups in seen:
                continue
            seen.append(groups)
            handles = [dist.new_group(members) for members in groups]  # every rank, same order
            ops = COLLECTIVE_OPS + (("p2p",) if g == 2 else ())
            for op in ops:
                if progress is not None:
                    progress(f"{op} g={g} {'strided' if strided else 'adjacent'}")
                curves.append(profile_collective(op, groups, handles, sizes=sizes,
                                                 local_world_size=local, world=world,
                                                 device=device, dtype=dtype,
                                                 repeats=repeats))
        g *= 2
    return curves
