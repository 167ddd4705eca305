"""Plans and per-rank measurement for tools/bench_costmodel.py (imported by spawned ranks).

Legend: b = micro-batch (all replicas), s = sequence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.plan import LayerStrategy, ParallelPlan, VocabStrategy
from megatron_ext.planner.profile.load import readings_around
from megatron_ext.specs import ModelSpec

BENCH_MODEL = ModelSpec(
    name="bench-gpt", num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8,
    num_query_groups=8, vocab_size=2048, tied_embeddings=True, activation="gelu",
    normalization="LayerNorm", position_embedding="learned_absolute",
    max_position_embeddings=256, add_bias_linear=True,
)
"""A small GPT-3-style model: big enough that compute, not Python overhead, dominates on CPU."""
SEQ_LENGTH = 128
MICRO_BATCH = 8
GLOBAL_BATCH = 32


def _plan(name: str, layers: list[LayerStrategy], *, pp: int = 1,
          stages: list[tuple[int, int]] | None = None, vocab_tp: int = 1,
          world: int = 4, micro_batch: int = MICRO_BATCH) -> tuple[str, ParallelPlan]:
    stages = stages or [(i * len(layers) // pp, (i + 1) * len(layers) // pp) for i in range(pp)]
    return name, ParallelPlan(
        world_size=world, pp=pp, stages=tuple(stages), layers=tuple(layers), model=BENCH_MODEL,
        micro_batch_size=micro_batch, global_batch_size=GLOBAL_BATCH, seq_length=SEQ_LENGTH,
        vocab=VocabStrategy(tp=vocab_tp), precision="fp32")


def bench_plans() -> list[tuple[str, ParallelPlan]]:
    """Uniform and heterogeneous plans on 4 ranks, with and without pipeline, recomputation
    and ZeRO-1 (the runtime does not run ZeRO-3), and a few micro-batch sizes, so that step
    times spread widely enough for a rank correlation to mean something."""
    n = BENCH_MODEL.num_layers
    L = LayerStrategy
    return [
        _plan("dp4", [L(dp=4)] * n),
        _plan("dp4 zero1", [L(dp=4, zero=1)] * n),
        _plan("dp4 full-rc", [L(dp=4, recompute="full")] * n),
        _plan("dp4 mb4 (8 micro-batches)", [L(dp=4)] * n, micro_batch=4),
        _plan("tp2 dp2", [L(tp=2, dp=2)] * n, vocab_tp=2),
        _plan("tp4 sp", [L(tp=4, sp=True, dp=1)] * n, vocab_tp=4),
        _plan("tp4 sp full-rc", [L(tp=4, sp=True, dp=1, recompute="full")] * n, vocab_tp=4),
        _plan("tp2sp dp2 z1 sel-rc", [L(tp=2, sp=True, dp=2, zero=1, recompute="selective")] * n,
              vocab_tp=2),
        _plan("pp2 dp2", [L(dp=2)] * n, pp=2),
        _plan("pp2 tp2", [L(tp=2, dp=1)] * n, pp=2, vocab_tp=2),
        _plan("pp4", [L(dp=1)] * n, pp=4),
        _plan("pp4 mb32 (1 micro-batch)", [L(dp=1)] * n, pp=4, micro_batch=32),
        _plan("pp2 dp2 mb16 (2 micro-batches)", [L(dp=2)] * n, pp=2, micro_batch=16),
        _plan("het tp2dp2|dp4", [L(tp=2, dp=2)] * 2 + [L(dp=4)] * 2),
        _plan("het dp4 rc 2/4", [L(dp=4, recompute="full")] * 2 + [L(dp=4)] * 2),
        _plan("het pp2 1|3 tp2-rc|dp2-z1", [L(tp=2, dp=1, recompute="full")]
              + [L(dp=2, zero=1)] * 3, pp=2, stages=[(0, 1), (1, 4)]),
    ]


def _batches(plan: ParallelPlan, count: int, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, plan.model.vocab_size, (plan.micro_batch_size,
                                                       plan.seq_length + 1), generator=gen)
        out.append({"tokens": ids[:, :-1], "labels": ids[:, 1:],  # [b, s] each
                    "loss_mask": torch.ones(plan.micro_batch_size, plan.seq_length)})
    return out


def _probe(probe: Any, rank: int, world_size: int) -> dict[str, float]:
    """One reading of the machine (planner/profile/load.py): rank 0 runs the profiler's layer
    stack alone (the others wait in a barrier, which does not spin), then every rank at once;
    alone = rank 0's mean and fastest step, shared = the median over ranks of their mean step,
    as the profiler takes them."""
    dist.barrier()
    alone = probe.steps_s() if rank == 0 else [0.0]
    dist.barrier()
    shared = probe.shared_steps_s()
    mine = torch.tensor([sum(alone) / len(alone), min(alone), sum(shared) / len(shared)],
                        dtype=torch.float64)
    every = [torch.zeros(3, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(every, mine)
    return {"alone_s": float(every[0][0]), "alone_min_s": float(every[0][1]),
            "shared_s": float(statistics.median(float(e[2]) for e in every))}


PIECES = ("zero_grad_s", "forward_s", "backward_s", "grad_sync_s", "optimizer_s", "step_s",
          "cpu_s", "main_cpu_s", "page_faults")
"""What `_piece_step` records per rank: wall seconds of zeroing the gradient buffers, of
megatron-core's forward_step and backward_step calls (every micro-batch; pipeline waits are
outside them), of finalize_model_grads (the data-parallel reduction, tied-embedding and
layer-norm all-reduces), of optimizer.step() (gradient norm and its all-reduce, clipping, Adam,
ZeRO-1 all-gather), the whole step; the rank's CPU seconds (all threads: gloo runs collectives
on threads of its own), its main thread's, and minor page faults in the step."""


@contextlib.contextmanager
def _timed(owner: Any, name: str, acc: dict[str, float], key: str) -> Iterator[None]:
    """Add the wall seconds of every call of `owner.name` to acc[key] while inside."""
    fn = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, fn)


def _piece_step(backend: Any, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """One training step as train_step runs it, with its pieces timed (PIECES)."""
    from megatron.core.pipeline_parallel import schedules

    acc: dict[str, float] = {}
    configs = list({id(c.module.config): c.module.config for c in backend.model}.values())
    with contextlib.ExitStack() as stack:
        stack.enter_context(_timed(schedules, "forward_step", acc, "forward_s"))
        stack.enter_context(_timed(schedules, "backward_step", acc, "backward_s"))
        stack.enter_context(_timed(backend.optimizer, "step", acc, "optimizer_s"))
        for config in configs:
            stack.enter_context(_timed(config, "finalize_model_grads_func", acc, "grad_sync_s"))
        dist.barrier()
        faults, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
        main_cpu = time.thread_time()
        t0 = time.perf_counter()
        for chunk in backend.model:
            chunk.zero_grad_buffer()
        backend.optimizer.zero_grad()
        acc["zero_grad_s"] = time.perf_counter() - t0
        backend.forward_backward(iter(batches), None, False)
        backend.optimizer.step()
        acc["step_s"] = time.perf_counter() - t0
    acc["cpu_s"] = time.process_time() - cpu
    acc["main_cpu_s"] = time.thread_time() - main_cpu
    acc["page_faults"] = float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    return {k: acc.get(k, 0.0) for k in PIECES}


def measure_rank(rank: int, world_size: int, *, plans: list[dict[str, Any]], rounds: int,
                 steps: int, overlap_grad_reduce: bool, probe_grid: Any = None,
                 pieces: int = 0) -> list[dict[str, Any]]:
    """Build every plan once, then `rounds` round-robin passes of 1 warm-up + `steps` timed
    steps per plan (so load drift on a shared machine hits all plans alike). A step's time is
    the slowest rank's; per plan the fastest timed step (the one least disturbed by other
    processes, like the profilers' fastest-of-repeats) and the median.

    With `probe_grid` (the model profile's ProfileGrid) the machine is probed before every
    plan's steps and after the last plan of each round (`_probe`); each plan gets, in every
    round, the readings right before and after its own steps and PROBE_WINDOW more on each side
    (`probes`, planner/profile/load.py: readings_around).

    With `pieces` > 0, after the last round every plan runs that many more steps with their
    pieces timed (`_piece_step`; the timers stay out of the timed steps): per plan and piece
    the median over steps, per rank."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_ext.megatron_adapter.build import build_model
    from megatron_ext.megatron_adapter.optimizer import build_optimizer
    from megatron_ext.megatron_adapter.training.loop import train_step
    from megatron_ext.megatron_adapter.training.select import backend_for_model

    built = []
    for data in plans:
        plan = ParallelPlan.from_dict(data)
        ddp = DistributedDataParallelConfig(overlap_grad_reduce=overlap_grad_reduce)
        chunks, groups = build_model(plan, seed=11, ddp_config=ddp)
        opt = build_optimizer(chunks, OptimizerConfig(
            optimizer="adam", lr=1e-4, weight_decay=0.01, clip_grad=1.0, bf16=False, fp16=False,
            params_dtype=torch.float32))
        backend = backend_for_model(chunks, groups, opt)
        batches = [backend.shard.rows(b) for b in _batches(plan, plan.num_microbatches)]
        built.append((plan, backend, batches))
    probe = None
    if probe_grid is not None:
        from megatron_ext.megatron_adapter.profile_model import SharingProbe

        single, _ = dist.new_subgroups(group_size=1)
        probe = SharingProbe(built[0][0].model, precision=built[0][0].precision,
                             grid=probe_grid, single=single)
    times: list[list[float]] = [[] for _ in built]
    probes: list[list[dict[str, float]]] = [[] for _ in built]
    losses: list[float] = [0.0] * len(built)
    for _ in range(rounds):
        sequence = [_probe(probe, rank, world_size)] if probe else []
        for i, (_plan, backend, batches) in enumerate(built):
            for step in range(steps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                out = train_step(backend, iter(batches))
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step > 0:
                    times[i].append(float(elapsed))
                losses[i] = out.loss
            if probe:
                sequence.append(_probe(probe, rank, world_size))
        if probe:
            for i in range(len(built)):
                probes[i] += readings_around(sequence, i)
    timed: list[list[dict[str, float]]] = []
    for _plan, backend, batches in built if pieces else []:
        _piece_step(backend, batches)  # warm the wrappers' first call
        runs = [_piece_step(backend, batches) for _ in range(pieces)]
        mine = {k: statistics.median(r[k] for r in runs) for k in PIECES}
        every: list[Any] = [None] * world_size
        dist.all_gather_object(every, mine)
        timed.append(every)
    return [{"measured_s": min(t), "median_s": statistics.median(t), "max_s": max(t),
             "loss": loss, "probes": pr, **({"pieces": timed[i]} if pieces else {})}
            for i, (t, loss, pr) in enumerate(zip(times, losses, probes))]


def profile_hardware_rank(rank: int, world_size: int, **kwargs: Any) -> dict[str, Any] | None:
    """Spawned rank: run the hardware profiler; rank 0 returns the profile's JSON dict."""
    from megatron_ext.runtime.profile_hardware import profile_hardware

    profile = profile_hardware(world=dist.group.WORLD, device=torch.device("cpu"),
                               local_world_size=world_size, **kwargs)
    return profile.to_dict() if rank == 0 else None


def fastest_cluster(profiles: list[Any]) -> Any:
    """Merge cluster profiles of several rounds: per collective point the median time (each
    round's is already a median: the typical time a step pays, runtime/profile_hardware.py),
    the highest peak and compute slots, the smallest overlap slowdown (the least disturbed
    compute measurements)."""
    from megatron_ext.planner.profile.profiles import fitted_link

    first = profiles[0]
    curves = tuple(dataclasses.replace(c, seconds=tuple(
        statistics.median(p.collectives[i].seconds[j] for p in profiles)
        for j in range(len(c.seconds)))) for i, c in enumerate(first.collectives))
    ar = [c for c in curves if c.collective == "all_reduce"]
    intra = fitted_link([c for c in ar if not c.crosses_nodes]) or first.cluster.intra_node
    inter = fitted_link([c for c in ar if c.crosses_nodes]) or intra
    cluster = dataclasses.replace(first.cluster, intra_node=intra, inter_node=inter,
                                  peak_flops=max(p.cluster.peak_flops for p in profiles))
    return dataclasses.replace(
        first, cluster=cluster, collectives=curves,
        overlap_slowdown=min(p.overlap_slowdown for p in profiles),
        compute_slots_per_node=max(p.compute_slots_per_node for p in profiles),
        comm_cpu_share=statistics.median(p.comm_cpu_share for p in profiles))


def fastest_model(profiles: list[Any]) -> Any:
    """Merge model profiles of several rounds: fastest time per field, except the recompute
    terms (differences of two times), the sharing slowdown (a ratio) and the stack's alone
    time it was measured against, whose median is kept (the smallest sharing slowdown is biased
    low, see profile_model.SHARING_ROUNDS; the alone time is compared with later probes' medians,
    planner/profile/load.py)."""
    def merge(samples: tuple) -> Any:
        values = {}
        for f in dataclasses.fields(samples[0]):
            items = [getattr(s, f.name) for s in samples]
            if not isinstance(items[0], float):
                values[f.name] = items[0]
            elif f.name in ("recompute_s", "selective_recompute_s"):
                values[f.name] = float(statistics.median(items))
            else:
                values[f.name] = min(items)
        return type(samples[0])(**values)

    first = profiles[0]
    alone = [p.sharing_alone_s for p in profiles]
    return dataclasses.replace(
        first, sharing_slowdown=float(statistics.median(p.sharing_slowdown for p in profiles)),
        sharing_alone_s=None if None in alone else float(statistics.median(alone)),
        **{key: tuple(merge(group) for group in zip(*(getattr(p, key) for p in profiles)))
           for key in ("layers", "vocab", "optimizer")})
