"""Checkpoint save and load time and size, synchronous against --async-save saves.

    python tools/bench_checkpoint.py [--repeats 3] [--json bench_checkpoint.json]

The CPU walk-through's model and step-5 layout (docs/walkthrough.md: 4 layers, hidden 64,
4 heads, seq 32, a 300-token vocabulary; tp=2 x dp=2 on 4 gloo ranks, Adam), built by
pretrain_gpt.py's own code from the same Megatron-LM flags, saved by checkpoint.py as training
saves it (weights, Adam moments, scheduler, RNG; manifest, rename, tracker) and loaded back:

  sync save        `save_checkpoint` until the checkpoint is published (what a step waits).
  async save       --async-save, one writer process per save (Megatron-LM's default): the time
                   the training step waits (`blocked`) and the time until the finalize published
                   it (`published`, a blocking finalize right after the save).
  async persistent the same with --use-persistent-ckpt-worker --ckpt-assume-constant-structure
                   (one writer process for the run, the save plan cached after the first save).
  load             `load_checkpoint` of the last sync save (resolve + verify + read + restore).

Each time is the slowest rank's, the median over --repeats saves (each a new iteration; the
first save of each kind, which starts the writer processes, is reported apart as `first`). Size:
the bytes of one published iteration directory. A benchmark, not a test: no assertion on the
figures; the machine's load average is recorded with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_ext.runtime.testing import run_distributed

WORLD = 4
VOCAB = 300  # the walk-through's BPE vocabulary
FLAGS = [
    "--cpu", "--transformer-impl", "local", "--num-layers", "4", "--hidden-size", "64",
    "--num-attention-heads", "4", "--max-position-embeddings", "256", "--seq-length", "32",
    "--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
    "--train-iters", "30", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "3",
]
KINDS = ("sync", "async", "async persistent")


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _worker(rank: int, world_size: int, root: str, repeats: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    from megatron_ext.flags.parser import parse_megatron_args
    from megatron_ext.flags.to_plan import plan_from_megatron_args
    from megatron_ext.megatron_adapter.cpu import compat
    from megatron_ext.megatron_adapter.training import pretrain
    from megatron_ext.megatron_adapter.training.checkpoint import (
        TrainState,
        load_checkpoint,
        prewarm_checkpoint_writer,
        save_checkpoint,
    )
    from megatron_ext.megatron_adapter.training.checkpoint_async import AsyncSaver
    from megatron_ext.megatron_adapter.training.checkpoint_files import resolve_load
    from megatron_ext.megatron_adapter.training.checkpoint_optim import materialize_state
    from megatron_ext.megatron_adapter.training.checkpoint_write import bytes_under, save_strategy
    from megatron_ext.megatron_adapter.training.loop import build_scheduler
    from megatron_ext.megatron_adapter.training.select import build_backend

    compat.apply(force=True)
    args = parse_megatron_args(FLAGS, world_size=world_size)
    plan = plan_from_megatron_args(args, world_size, vocab_size=VOCAB)
    config = pretrain.run_config_from_args(args, plan)
    prewarm_checkpoint_writer()  # as pretrain.py does before building the model
    backend = build_backend(config, pretrain._padded_vocab(config, VOCAB, None))
    scheduler = build_scheduler(config, backend.optimizer)
    materialize_state(backend.optimizer)  # Adam's moments, as after a first step
    out: dict[str, Any] = {"parameters": sum(p.numel() for chunk in backend.model
                                             for p in chunk.parameters())}
    for kind in KINDS:
        save = Path(root) / kind.replace(" ", "_")
        saver = None if kind == "sync" else AsyncSaver(persistent=kind == "async persistent")
        strategy = save_strategy(cached=True) if kind == "async persistent" else None
        blocked, published = [], []
        for i in range(1, repeats + 2):
            state = TrainState(iteration=i)

            def save_once(state: TrainState = state, saver: Any = saver, save: Path = save,
                          strategy: Any = strategy) -> None:
                save_checkpoint(save, backend, scheduler, state, plan, saver=saver,
                                strategy=strategy)

            wait = _slowest(_timed(save_once))
            done = wait if saver is None else wait + _slowest(_timed(
                lambda saver=saver: saver.maybe_finalize(blocking=True)))
            blocked.append(wait)
            published.append(done)
        if saver is not None:
            saver.close()
        size = bytes_under(save / f"iter_{repeats + 1:07d}")
        out[kind] = {"first_blocked_s": blocked[0], "first_published_s": published[0],
                     "blocked_s": statistics.median(blocked[1:]),
                     "published_s": statistics.median(published[1:]), "bytes": size}
    target = resolve_load(Path(root) / "sync")
    assert target is not None
    loads = [_slowest(_timed(lambda: load_checkpoint(target, backend, scheduler, plan)))
             for _ in range(repeats)]
    out["load"] = {"load_s": statistics.median(loads)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="saves and loads per kind (median)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (a temp dir)")
    args = ap.parse_args(argv)
    import tempfile

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        start = time.perf_counter()
        result = run_distributed(_worker, world_size=WORLD, timeout_s=1800,
                                 collective_timeout_s=600, root=root,
                                 repeats=args.repeats)[0]
        wall = time.perf_counter() - start
    load_after = os.getloadavg()
    out = {"model": "walk-through tiny-gpt (4 layers, hidden 64, vocab 300), tp2 x dp2, 4 gloo "
                    "ranks, fp32 + Adam", "parameters_per_rank_0": result["parameters"],
           "repeats": args.repeats, "results": {k: result[k] for k in (*KINDS, "load")},
           "load_average_1min": [round(load_before[0], 2), round(load_after[0], 2)],
           "cpu_count": os.cpu_count(), "wall_s": round(wall, 1)}
    print(f"{'save':18s} {'first blocked':>14s} {'first published':>16s} {'blocked':>9s} "
          f"{'published':>10s} {'size (KiB)':>11s}")
    for kind in KINDS:
        r = out["results"][kind]
        print(f"{kind:18s} {r['first_blocked_s']:13.2f}s {r['first_published_s']:15.2f}s "
              f"{r['blocked_s']:8.2f}s {r['published_s']:9.2f}s {r['bytes'] / 1024:11.1f}")
    print(f"load (last sync save): {out['results']['load']['load_s']:.2f}s; "
          f"load average {out['load_average_1min'][0]} -> {out['load_average_1min'][1]} "
          f"on {out['cpu_count']} CPUs; {out['wall_s']}s in all")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
