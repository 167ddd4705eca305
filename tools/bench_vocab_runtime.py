"""Vocabulary parallelism on the layerwise heterogeneous runtime: stage balance on CPU.

tools/bench_vocab.py measures the vocabulary passes around stock megatron-core stage bodies; this
measures them where training runs them: `build_model(plan)` + the backend's `forward_backward` +
the runtime's chained Adam, on a heterogeneous plan (4 gloo ranks, pp=2: stage 0 tp2+sp, stage 1
dp2, `--layers` split evenly, fp32), with vocab.mode tp (Megatron's layout, vocab.tp=2:
embedding on stage 0, output layer and loss on stage 1) against vocab_parallel (vocab.tp=2, the
vocabulary over all 4 ranks, 1 barrier). Per rank and iteration:
  busy time   = main-thread CPU seconds of forward_backward (`time.thread_time`; waits sleep),
                the minimum over the timed iterations;
  peak memory = peak live tensor bytes during one forward_backward (LiveTensorTracker; the
                vocabulary collectives' buffers are made on the main thread) on top of
                parameters, grad buffers and Adam states.
A stage's value is the max over its ranks; imbalance = max / min over stages.

    python tools/bench_vocab_runtime.py --json vocab_runtime.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from megatron_ext.warning_filters import install as install_warning_filters

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIB = 2**20


def _plan(cfg: dict[str, Any], vocab: int, mode: str) -> Any:
    from megatron_ext.plan import LayerStrategy, ParallelPlan, VocabStrategy
    from megatron_ext.specs import ModelSpec

    h, n = cfg["hidden"], cfg["layers"]
    model = ModelSpec(num_layers=n, hidden_size=h, ffn_hidden_size=4 * h,
                      num_attention_heads=cfg["heads"], num_query_groups=cfg["heads"],
                      vocab_size=vocab, activation="gelu", normalization="LayerNorm",
                      max_position_embeddings=cfg["seq"])
    layers = (LayerStrategy(tp=2, sp=True),) * (n // 2) + (LayerStrategy(dp=2),) * (n - n // 2)
    return ParallelPlan(
        world_size=4, pp=2, stages=((0, n // 2), (n // 2, n)), layers=layers, model=model,
        micro_batch_size=cfg["mbs"], global_batch_size=cfg["mbs"] * cfg["microbatches"],
        seq_length=cfg["seq"], precision="fp32", vocab=VocabStrategy(mode=mode, tp=2))


def _batches(plan: Any) -> list[dict[str, Any]]:
    """Full `[b, s]` micro-batches, the same on every rank (fixed seed)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    shape = (plan.micro_batch_size, plan.seq_length)
    return [{"tokens": torch.randint(0, plan.model.vocab_size, shape, generator=gen),
             "labels": torch.randint(0, plan.model.vocab_size, shape, generator=gen),
             "loss_mask": torch.ones(shape)} for _ in range(plan.num_microbatches)]


def _static_tensors(chunks: list, optimizer: Any) -> list:
    from megatron_ext.runtime.vocab.profiling import optimizer_state_tensors

    params = [p for chunk in chunks for p in chunk.module.parameters()]
    states = [t for opt in optimizer.chained_optimizers
              for t in optimizer_state_tensors(opt.optimizer)]
    return params + [getattr(p, "main_grad", None) for p in params] + states


def _measure_one(cfg: dict[str, Any], vocab: int, mode: str) -> dict[str, Any]:
    import gc

    import torch
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig

    from megatron_ext.megatron_adapter.build import build_model
    from megatron_ext.megatron_adapter.optimizer import build_optimizer
    from megatron_ext.megatron_adapter.training.select import backend_for_model
    from megatron_ext.runtime.vocab.profiling import LiveTensorTracker

    plan = _plan(cfg, vocab, mode)
    chunks, groups = build_model(plan, seed=1, make_vocab_size_divisible_by=1)
    optimizer = build_optimizer(chunks, OptimizerConfig(
        optimizer="adam", lr=1e-5, bf16=False, fp16=False, params_dtype=torch.float32))
    backend = backend_for_model(chunks, groups, optimizer)
    micro = [backend.shard.rows(b) for b in _batches(plan)]

    def run(tracker: Any = None) -> None:
        backend.forward_backward(iter(micro))

    busy = []
    for it in range(1 + cfg["iterations"]):  # the first warms up and creates Adam states
        chunks[0].zero_grad_buffer()
        optimizer.zero_grad()
        dist.barrier()
        start = time.thread_time()
        run()
        if it > 0:
            busy.append(time.thread_time() - start)
        optimizer.step()
    gc.collect()
    chunks[0].zero_grad_buffer()
    tracker = LiveTensorTracker()
    tracker.register(_static_tensors(chunks, optimizer))
    with tracker:
        run(tracker)
    return {"vocab": vocab, "mode": mode, "rank": dist.get_rank(), "stage": groups.stage,
            "busy_s": min(busy), "peak_bytes": float(tracker.peak_bytes)}


def measure_rank(rank: int, world_size: int, **cfg: Any) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(1)  # one intra-op thread per rank: busy time is the rank's compute
    return [_measure_one(cfg, vocab, mode) for vocab in cfg["vocab"]
            for mode in ("tp", "vocab_parallel")]


def summarise(results: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for index, first in enumerate(results[0]):
        per_rank = [r[index] for r in results]
        busy = [max(r["busy_s"] for r in per_rank if r["stage"] == s) for s in (0, 1)]
        peak = [max(r["peak_bytes"] for r in per_rank if r["stage"] == s) for s in (0, 1)]
        rows.append({"vocab": first["vocab"], "mode": first["mode"], "stage_busy_s": busy,
                     "stage_peak_mib": [p / MIB for p in peak],
                     "time_imbalance": max(busy) / min(busy),
                     "memory_imbalance": max(peak) / min(peak), "per_rank": per_rank})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--mbs", type=int, default=2, help="samples over all replicas")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=2, help="timed, after one warm-up")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    cfg = {k: v for k, v in vars(args).items() if k != "json"}

    from megatron_ext.runtime.testing import run_distributed

    results = run_distributed(measure_rank, world_size=4, timeout_s=3000,
                              collective_timeout_s=600, **cfg)
    rows = summarise(results)
    print("| vocab | vocab.mode | stage busy s | time max/min | stage peak MiB | mem max/min |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['vocab'] // 1024}k | {r['mode']} | "
              f"{' '.join(f'{b:.3f}' for b in r['stage_busy_s'])} | {r['time_imbalance']:.2f} | "
              f"{' '.join(f'{m:.0f}' for m in r['stage_peak_mib'])} | "
              f"{r['memory_imbalance']:.2f} |")
    if args.json:
        last = max(cfg["vocab"])
        summary = {key: {r["mode"]: r[key] for r in rows if r["vocab"] == last}
                   for key in ("time_imbalance", "memory_imbalance")}
        args.json.write_text(json.dumps({"config": cfg, "rows": rows,
                                         "summary": {"vocab": last, **summary}}, indent=1))
    return 0


if __name__ == "__main__":
    install_warning_filters()
    sys.exit(main())
