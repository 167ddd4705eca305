"""Model profiler: a real megatron-core TransformerLayer (and vocabulary layers, optimizer step)
timed at several tp / sp / micro-batch / sequence shapes -> ModelProfile.

Legend: s = sequence, b = micro-batch of one replica, h = hidden, v = padded vocabulary.

Each shape is built exactly as the runtime builds it (`layers.layer_config` / `layer_spec`, the
same TP/SP modules) inside a process whose default group is torch's `fake` backend of size
max(tp): the TP collectives are no-ops, so the times are the shard's compute alone (the cost
model adds communication from the cluster profile). Every shape is measured by one process alone.
With `concurrency` > 1 (ranks that will share this device, e.g. the 4 ranks of a 2-core CPU),
that many processes then run a stack of the model's layers (up to 8, one shape) back to back at
once, and the ratio of their time per step to the solo time is the profile's `sharing_slowdown`
(time-slicing, caches and memory bandwidth included; alone and shared loops alternate and each
side keeps its median, robust to a burst of other work); on GPUs use 1. A few steps of the same
stack are also timed alone in every round of the shape measurements; the fastest is kept
(`sharing_alone_s`): `SharingProbe` re-runs the stack later inside training ranks, so a
benchmark can see how the machine changed between profiling and a timed run. GPU memory comes
from the CUDA allocator; on CPU only time is measured and the cost model keeps its analytic
memory.
"""

from __future__ import annotations

import dataclasses
import queue
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron_ext.planner.profile.profiles import (
    LayerSample,
    ModelProfile,
    OptimizerSample,
    VocabSample,
)
from megatron_ext.runtime.host_memory import keep_freed_memory_mapped
from megatron_ext.specs import ModelSpec

__all__ = ["ProfileGrid", "SharingProbe", "profile_model"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProfileGrid:
    """Shapes to measure."""

    tps: tuple[int, ...] = (1, 2, 4)
    """Tensor-parallel degrees (each divides the heads); sp is measured too for tp > 1."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    """Samples per replica."""
    seq_lengths: tuple[int, ...] = (64, 128)
    """Sequence lengths (each divisible by every tp, for sp)."""
    repeats: int = 3
    """Timed runs per shape after one warm-up; the fastest is kept (the run least disturbed by
    other work on a shared machine; on a dedicated GPU runs barely differ)."""

    def __post_init__(self) -> None:
        if not self.tps or not self.micro_batch_sizes or not self.seq_lengths or self.repeats < 1:
            raise ValueError(f"empty profile grid {self}")


def _timer(device: torch.device) -> Callable[[], float]:
    if device.type == "cuda":
        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return now
    return time.perf_counter


class _Worker:
    """State of one measuring process (fake default group of size max(tp))."""

    def __init__(self, model: ModelSpec, precision: str, device: torch.device,
                 sync: Callable[[], None], max_tp: int) -> None:
        import torch.distributed as dist
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers "fake"
        from megatron.core import tensor_parallel

        from megatron_ext.megatron_adapter.build import prepare_megatron
        from megatron_ext.megatron_adapter.transformer_config import transformer_config

        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=max_tp)
        prepare_megatron()
        tensor_parallel.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0,
                                                        force_reset_rng=True)
        self.model, self.device, self.sync, self.now = model, device, sync, _timer(device)
        self.base = transformer_config(model, precision=precision)
        self.single = dist.new_group([0])
        self.tp_groups = {tp: dist.new_group(list(range(tp))) for tp in range(1, max_tp + 1)}

    def pgc(self, tp: int) -> Any:
        from megatron.core.process_groups_config import ProcessGroupCollection

        one = self.single
        return ProcessGroupCollection(tp=self.tp_groups[tp], cp=one, pp=one, embd=None,
                                      pos_embd=None, dp=one, dp_cp=one, intra_dp_cp=one)

    def timed(self, fn: Callable[[], Any], repeats: int) -> list[float]:
        """[seconds of fn()] * repeats, each started together with the other workers."""
        fn()
        out = []
        for _ in range(repeats):
            self.sync()
            t0 = self.now()
            fn()
            out.append(self.now() - t0)
        return out


def _layer(w: _Worker, tp: int, sp: bool, recompute: str) -> torch.nn.Module:
    from megatron.core.transformer.spec_utils import build_module

    from megatron_ext.megatron_adapter.layers import layer_config, layer_spec
    from megatron_ext.plan import LayerStrategy

    strategy = LayerStrategy(tp=tp, sp=sp, dp=1, recompute=recompute)  # type: ignore[arg-type]
    cfg = layer_config(w.base, strategy)
    layer = build_module(layer_spec(cfg, strategy, w.single), config=cfg, layer_number=1,
                         pg_collection=w.pgc(tp))
    return layer.to(w.device)


_KINDS = ("none", "full", "selective")
"""No recomputation, full (tensor_parallel.checkpoint around the layer), selective (core
attention, the layer's own config)."""


class _LayerShape:
    """One (tp, sp, b, s) shape: its input and a timed forward + backward of each kind."""

    def __init__(self, w: _Worker, layers: dict[str, torch.nn.Module], *, tp: int, sp: bool,
                 b: int, s: int) -> None:
        self.w, self.layers, self.key = w, layers, (tp, sp, b, s)
        self.rope = None
        if w.model.position_embedding == "rope":
            from megatron.core.models.common.embeddings.rotary_pos_embedding import (
                RotaryEmbedding,
            )

            rope = RotaryEmbedding(kv_channels=w.model.head_dim, rotary_percent=1.0)
            self.rope = rope(s).to(w.device)  # [s, 1, 1, d]
        self.x = torch.randn(s // (tp if sp else 1), b, w.model.hidden_size, device=w.device,
                             dtype=w.base.params_dtype, requires_grad=True)  # [s/tp if sp, b, h]
        self.runs: dict[str, list[tuple]] = {kind: [] for kind in _KINDS}

    def _run(self, layer: torch.nn.Module, inp: torch.Tensor) -> torch.Tensor:
        return layer(hidden_states=inp, attention_mask=None, rotary_pos_emb=self.rope)[0]

    def step(self) -> None:
        """One untimed forward + backward without recomputation."""
        out = self._run(self.layers["none"], self.x)
        out.backward(torch.ones_like(out))
        self.x.grad = None

    def measure(self, kind: str, keep: bool) -> None:
        """(forward s, backward s, kept bytes, peak bytes) of one run, started in lockstep."""
        from megatron.core import tensor_parallel

        w, x = self.w, self.x
        layer = self.layers["selective" if kind == "selective" else "none"]
        cuda = w.device.type == "cuda"
        base = torch.cuda.memory_allocated(w.device) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(w.device)
        w.sync()
        t0 = w.now()
        if kind == "full":
            out = tensor_parallel.checkpoint(lambda inp: self._run(layer, inp), False, x)
        else:
            out = self._run(layer, x)
        t1 = w.now()
        kept = (torch.cuda.memory_allocated(w.device) - base - out.numel() * out.element_size()
                if cuda else None)
        out.backward(torch.ones_like(out))
        t2 = w.now()
        peak = torch.cuda.max_memory_allocated(w.device) - base if cuda else None
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        if keep:
            self.runs[kind].append((t1 - t0, t2 - t1, kept, peak))

    def sample(self) -> LayerSample:
        tp, sp, b, s = self.key
        best = {kind: [min(r[i] for r in rs) for i in range(2)] for kind, rs in self.runs.items()}
        _, _, kept, peak = self.runs["none"][-1]
        return LayerSample(
            tp=tp, sp=sp, micro_batch_size=b, seq_length=s, forward_s=best["none"][0],
            backward_s=best["none"][1],
            recompute_s=max(0.0, best["full"][1] - best["none"][1]),
            selective_recompute_s=max(0.0, best["selective"][1] - best["none"][1]),
            activation_bytes=None if kept is None else float(max(kept, 0)),
            peak_bytes=None if peak is None else float(peak),
        )


STACK_REFERENCE_STEPS = 3
"""Steps of the sharing stack timed alone per round of shape measurements (`sharing_alone_s` is
the fastest): with one, a burst of other work during that one step (~0.3 s on the benchmark's
model) scaled every later prediction of the calibration benchmark's --quick run 9x; a
`SharingProbe` reading's fastest is likewise of the 2-3 steps of its 0.75 s loop."""


def _layer_samples(w: _Worker, grid: ProfileGrid, stack: list[_LayerShape]
                   ) -> tuple[list[LayerSample], float]:
    """Every shape, round-robin over `repeats + 1` rounds (the first warms up), so a change in
    the machine's load during profiling hits all shapes alike; the fastest run is kept. Each
    round also times STACK_REFERENCE_STEPS steps of the sharing `stack`: the fastest is the
    reference a later `SharingProbe` compares the machine's solo speed with (same rounds, same
    statistic as the samples it will scale)."""
    shapes = []
    for tp in grid.tps:
        for sp in (False, True) if tp > 1 else (False,):
            layers = {rc: _layer(w, tp, sp, rc) for rc in ("none", "selective")}
            shapes += [_LayerShape(w, layers, tp=tp, sp=sp, b=b, s=s)
                       for s in grid.seq_lengths for b in grid.micro_batch_sizes]
    stack_s = []
    for round_idx in range(grid.repeats + 1):
        for shape in shapes:
            for kind in _KINDS:
                shape.measure(kind, keep=round_idx > 0)
        for _ in range(STACK_REFERENCE_STEPS):
            t0 = w.now()
            for layer in stack:
                layer.step()
            if round_idx > 0:
                stack_s.append(w.now() - t0)
    return [shape.sample() for shape in shapes], min(stack_s)


def _vocab_sample(w: _Worker, *, tp: int, b: int, s: int, repeats: int) -> VocabSample:
    """Embedding lookup, output GEMM + vocab-parallel cross-entropy on [s, b] tokens."""
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron_ext.geometry.vocab_partition import padded_vocab_size
    from megatron_ext.megatron_adapter.cross_entropy import (
        group_vocab_parallel_cross_entropy,
    )
    from megatron_ext.megatron_adapter.layers import layer_config
    from megatron_ext.plan import LayerStrategy

    m, group = w.model, w.tp_groups[tp]
    cfg = layer_config(w.base, LayerStrategy(tp=tp, dp=1))
    vocab = padded_vocab_size(m.vocab_size, tp)
    emb = LanguageModelEmbedding(config=cfg, vocab_size=vocab,
                                 max_sequence_length=m.max_position_embeddings,
                                 position_embedding_type=m.position_embedding,
                                 scatter_to_sequence_parallel=False, tp_group=group).to(w.device)
    out_layer = ColumnParallelLinear(m.hidden_size, vocab, config=cfg, init_method=cfg.init_method,
                                     bias=False, gather_output=False,
                                     tp_group=group).to(w.device)
    ids = torch.randint(0, m.vocab_size, (b, s), device=w.device)  # [b, s]
    pos = torch.arange(s, device=w.device).expand(b, s)  # [b, s]
    target = torch.randint(0, vocab // tp, (s, b), device=w.device)  # [s, b] in this shard
    hidden = torch.randn(s, b, m.hidden_size, device=w.device, dtype=w.base.params_dtype,
                         requires_grad=True)  # [s, b, h]
    state: dict[str, torch.Tensor] = {}

    def emb_fwd() -> None:
        state["e"] = emb(input_ids=ids, position_ids=pos)  # [s, b, h]

    def emb_bwd() -> None:
        state["e"].backward(torch.ones_like(state["e"]))

    def out_fwd() -> None:
        logits, _ = out_layer(hidden)  # [s, b, v/tp]
        state["o"] = group_vocab_parallel_cross_entropy(logits, target, group)  # [s, b]

    def out_bwd() -> None:
        state["o"].sum().backward()

    def paired(fwd: Callable[[], None], bwd: Callable[[], None]) -> tuple[float, float]:
        f, bw = [], []
        for _ in range(repeats + 1):
            w.sync()
            t0 = w.now()
            fwd()
            t1 = w.now()
            bwd()
            t2 = w.now()
            f.append(t1 - t0)
            bw.append(t2 - t1)
        return min(f[1:]), min(bw[1:])

    ef, eb = paired(emb_fwd, emb_bwd)
    of, ob = paired(out_fwd, out_bwd)
    return VocabSample(tp=tp, tokens=b * s, embedding_forward_s=ef, embedding_backward_s=eb,
                       output_forward_s=of, output_backward_s=ob)


def _optimizer_sample(w: _Worker, params: list[torch.nn.Parameter], repeats: int
                      ) -> OptimizerSample:
    """torch AdamW (megatron-core's CPU fallback; FusedAdam on GPU) over `params`."""
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    step_s = min(w.timed(opt.step, repeats))
    return OptimizerSample(num_params=sum(p.numel() for p in params), step_s=step_s)


def _measure(w: _Worker, grid: ProfileGrid, with_vocab: bool, stack: list[_LayerShape]
             ) -> tuple[list[LayerSample], list[VocabSample], list[OptimizerSample], float]:
    layer_samples, stack_s = _layer_samples(w, grid, stack)
    vocab_samples, opt_samples = [], []
    for tp in grid.tps:
        params = [p for _ in range(4) for p in _layer(w, tp, False, "none").parameters()]
        n = len(params) // 4
        for k in (1, 4):
            opt_samples.append(_optimizer_sample(w, params[: k * n], grid.repeats))
        if with_vocab:
            for s in grid.seq_lengths:
                for b in grid.micro_batch_sizes:
                    vocab_samples.append(_vocab_sample(w, tp=tp, b=b, s=s, repeats=grid.repeats))
    return layer_samples, vocab_samples, opt_samples, stack_s


SHARING_SECONDS = 0.75
"""Wall time of each back-to-back loop that measures one worker alone."""
SHARED_WINDOW_SECONDS = 2.0
"""Window in which every worker computes at once: each keeps stepping until the window has
passed, and only its steps that ended inside it count (`_shared_steps_s`)."""
SHARING_ROUNDS = 3
"""Alternations of (worker 0 alone, all workers at once); each side keeps its median loop, so a
burst of other work on the machine during one loop does not skew the ratio."""


def _steady_steps_s(w: _Worker, shapes: list[_LayerShape]) -> list[float]:
    """Seconds of each forward + backward of the model's layer stack (one shape per layer, each
    with its own weights: the working set of a training step), run back to back for
    SHARING_SECONDS after one untimed step."""
    def step() -> None:
        for shape in shapes:
            shape.step()

    step()
    times, start = [], w.now()
    while w.now() - start < SHARING_SECONDS:
        t0 = w.now()
        step()
        times.append(w.now() - t0)
    return times


def _shared_steps_s(w: _Worker, shapes: list[_LayerShape],
                    window_s: float = SHARED_WINDOW_SECONDS) -> list[float]:
    """Seconds of each step of the layer stack that ended inside a window in which every
    worker computes (call right after the workers' barrier, on every worker). Each worker runs
    one untimed step, then steps until `window_s` after its first timed step began; the step
    that crosses the window's end is dropped, since the other workers may already be leaving
    their loops then (and this one ran faster). A loop that stops after a fixed time instead
    keeps its last step, run beside fewer and fewer workers: with steps near the loop's length
    that reads the sharing slowdown ~10% low. At least the first step is kept."""
    def step() -> None:
        for shape in shapes:
            shape.step()

    step()
    times: list[float] = []
    start = w.now()
    while True:
        t0 = w.now()
        step()
        end = w.now()
        if end - start > window_s:
            return times or [end - t0]
        times.append(end - t0)


def _steady_step_s(w: _Worker, shapes: list[_LayerShape]) -> float:
    """Mean seconds per step of `_steady_steps_s`."""
    times = _steady_steps_s(w, shapes)
    return sum(times) / len(times)


def _sharing_stack(w: _Worker, grid: ProfileGrid) -> list[_LayerShape]:
    """The layer stack the sharing slowdown is measured with: up to 8 of the model's layers at
    the grid's first tp, its middle micro-batch and its longest sequence."""
    tp, b = grid.tps[0], sorted(grid.micro_batch_sizes)[len(grid.micro_batch_sizes) // 2]
    return [_LayerShape(w, {"none": _layer(w, tp, False, "none")}, tp=tp, sp=False, b=b,
                        s=max(grid.seq_lengths)) for _ in range(min(w.model.num_layers, 8))]


class _GroupWorker(_Worker):
    """A worker inside a process group that already exists (a training rank): its own
    single-rank group stands in for every group of the layer, so only tp 1 is built."""

    def __init__(self, model: ModelSpec, precision: str, device: torch.device,
                 single: Any) -> None:
        from megatron.core import tensor_parallel

        from megatron_ext.megatron_adapter.build import prepare_megatron
        from megatron_ext.megatron_adapter.transformer_config import transformer_config

        prepare_megatron()
        if not tensor_parallel.get_cuda_rng_tracker().is_initialized():  # else the rank's own
            tensor_parallel.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0,
                                                            etp_rank=0)
        self.model, self.device, self.sync, self.now = model, device, lambda: None, _timer(device)
        self.base = transformer_config(model, precision=precision)
        self.single, self.tp_groups = single, {1: single}


class SharingProbe:
    """The profiler's sharing measurement, run again later inside a training rank: the same
    layer stack (`ProfileGrid` as profiled, first tp must be 1), so its time per step is
    comparable with the profile's `sharing_alone_s` and the ratio shared / alone with its
    `sharing_slowdown` (planner/profile/load.py). `single` is a process group holding only this
    rank (`torch.distributed.new_subgroups(1)`); call `steps_s` alone or on every rank at once."""

    def __init__(self, model: ModelSpec, *, precision: str, grid: ProfileGrid, single: Any,
                 device: str = "cpu") -> None:
        if grid.tps[0] != 1:
            raise ValueError(f"SharingProbe builds tp 1 only; the grid's first tp is "
                             f"{grid.tps[0]}")
        self.worker = _GroupWorker(model, precision, torch.device(device), single)
        self.stack = _sharing_stack(self.worker, grid)

    def steps_s(self) -> list[float]:
        """Seconds of each step of the stack, run back to back for SHARING_SECONDS (alone)."""
        return _steady_steps_s(self.worker, self.stack)

    def shared_steps_s(self) -> list[float]:
        """Seconds of each step of the stack while every rank runs it: call on every rank
        right after a barrier (`_shared_steps_s`)."""
        return _shared_steps_s(self.worker, self.stack)


def _worker_main(idx: int, model: ModelSpec, precision: str, grid: ProfileGrid, device: str,
                 threads: int | None, with_vocab: bool, barrier: Any, results: Any) -> None:
    """Worker 0 measures every shape alone (the others wait), then SHARING_ROUNDS times: worker
    0 runs the layer stack alone, then all workers run it at once."""
    import traceback

    try:
        if threads:
            torch.set_num_threads(threads)
        torch.set_flush_denormal(True)  # fake collectives leave garbage that may be subnormal
        if device == "cpu":  # allocate as a CPU training rank does (runtime/host_memory.py)
            keep_freed_memory_mapped()
        w = _Worker(model, precision, torch.device(device), lambda: None, max(grid.tps))
        stack = _sharing_stack(w, grid)
        samples = _measure(w, grid, with_vocab, stack) if idx == 0 else None
        alone, shared = [], []
        for _ in range(SHARING_ROUNDS):
            barrier.wait()
            if idx == 0:
                alone.append(_steady_step_s(w, stack))
            barrier.wait()
            times = _shared_steps_s(w, stack)
            shared.append(sum(times) / len(times))
        results.put((idx, "ok", (samples, statistics.median(alone) if alone else None,
                                 statistics.median(shared))))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        barrier.abort()
        results.put((idx, "error", traceback.format_exc()))


def profile_model(model: ModelSpec, *, precision: str = "fp32", grid: ProfileGrid | None = None,
                  concurrency: int = 1, threads: int | None = None, device: str | None = None,
                  with_vocab: bool = True, timeout_s: float = 3600.0) -> ModelProfile:
    """Measure `model` (see the module docstring); `concurrency` processes share the device."""
    grid = grid or ProfileGrid()
    for tp in grid.tps:
        if model.num_attention_heads % tp or model.num_query_groups % tp:
            raise ValueError(f"tp={tp} must divide the model's {model.num_attention_heads} "
                             f"heads and {model.num_query_groups} query groups")
        if any(s % tp for s in grid.seq_lengths):
            raise ValueError(f"sequence lengths {grid.seq_lengths} must be multiples of tp={tp}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(concurrency), ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(i, model, precision, grid, device, threads,
                                                    with_vocab, barrier, results))
             for i in range(concurrency)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(got) < concurrency:
            try:
                idx, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if i not in got and p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    why = f"worker {dead[0]} died" if dead else f"timed out after {timeout_s:g} s"
                    raise RuntimeError(f"model profiler: {why}") from None
                continue
            if status != "ok":
                raise RuntimeError(f"model profiler worker {idx} failed:\n{value}")
            got[idx] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    (layers, vocab, opt, stack_s), alone, _ = got[0]
    slowdown = max(1.0, statistics.median(got[i][2] for i in range(concurrency)) / alone)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return ModelProfile(model=model, precision=precision, device=name, concurrency=concurrency,
                        sharing_slowdown=round(slowdown, 4) if concurrency > 1 else 1.0,
                        sharing_alone_s=stack_s,
                        layers=tuple(layers), vocab=tuple(vocab), optimizer=tuple(opt))
