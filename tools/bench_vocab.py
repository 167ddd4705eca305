"""Vocabulary parallelism vs Megatron's layout: stage balance on CPU, and gains at paper scale.

Part 1 (measured, 4 gloo ranks, pp=4, tp=1, fp32): a GPT body of `--layers-per-stage` megatron-core
TransformerLayers per stage, untied vocabulary layers, vocabularies 32k/64k/128k. Baseline:
`TpVocabStage` (embedding on stage 0, output layer + cross-entropy on stage 3) under Megatron's
1F1B; vocabulary parallel: the same body under `forward_backward_vocab_parallel` (1 barrier).
Per stage and iteration:
  busy time   = main-thread CPU seconds of the forward-backward call (`time.thread_time`; one
                intra-op thread per rank, so compute runs there; waits sleep and do not count),
                the minimum over the timed iterations (other processes on the shared cores
                only ever add time). Robust to the 2 shared cores the ranks run on, unlike wall
                time.
  peak memory = peak bytes of live tensor storages during one iteration (LiveTensorTracker,
                main thread): parameters, gradients, Adam states, saved activations,
                the vocabulary passes' buffers.
  iteration   = wall seconds (contended: 4 ranks on the machine's cores) and "simulated": the
                measured per-pass CPU times replayed through the pipeline simulation (what
                dedicated cores would take; communication time not included).
Part 2 (predicted): throughput gain at the paper's scale (4B-class model on 8 GPUs, 21B on 32;
vocab 32k-256k; seq 2048/4096; 128 micro-batches of 1) from the search cost model
(megatron_ext.planner.cost.evaluate) and from this package's pass-level pipeline simulation,
beside the paper's Table 5 (Vocab-2, the 1-barrier algorithm, vs baseline and vs layer
redistribution).

    python tools/bench_vocab.py --json vocab_bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from megatron_ext.warning_filters import install as install_warning_filters

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ranks import this module by name
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PP = 4
MIB = 2**20


def _build(env: dict[str, Any], vocab: int, mode: str) -> tuple[Any, Any]:
    import torch

    from megatron_ext.megatron_adapter.vocab.baseline import (
        TpVocabStage,
        build_stage_body,
    )
    from megatron_ext.megatron_adapter.vocab.layers import (
        VocabParallelLayers,
        VocabParallelStage,
    )

    stage, config = env["stage"], env["config"]
    body = build_stage_body(config, env["layers_per_stage"], is_last=stage == PP - 1)

    def init(weight: torch.Tensor) -> None:
        torch.nn.init.normal_(weight, std=0.02)

    if mode == "baseline":
        model = TpVocabStage(body, vocab_size=vocab, is_first=stage == 0,
                             is_last=stage == PP - 1, init_method=init)
    else:
        layers = VocabParallelLayers(config=config, vocab_size=vocab,
                                     hidden_size=config.hidden_size, group=env["groups"].vocab,
                                     tie_embeddings=False, init_method=init)
        model = VocabParallelStage(body, layers)
    return model, torch.optim.Adam(model.parameters(), lr=1e-5)


def _iteration(env: dict[str, Any], model: Any, mode: str, timer: dict[str, Any]) -> None:
    """One forward-backward call; per-pass CPU seconds go to `timer`."""
    import time as _time

    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    from megatron_ext.megatron_adapter.vocab.baseline import (
        block_forward_step,
        tp_vocab_forward_step,
    )
    from megatron_ext.megatron_adapter.vocab.layers import VocabScheduleOptions
    from megatron_ext.megatron_adapter.vocab.schedule import (
        make_vocab_parallel_schedule,
    )

    kwargs = {"data_iterator": iter(env["data"]), "model": [model],
              "num_microbatches": env["microbatches"], "seq_length": env["seq"],
              "micro_batch_size": env["mbs"]}
    if mode == "baseline":
        def step(iterator: Any, stage_model: Any) -> Any:
            start = _time.thread_time()
            out = tp_vocab_forward_step(iterator, stage_model)
            timer["F"].append(_time.thread_time() - start)
            return out

        forward_backward_pipelining_without_interleaving(forward_step_func=step, **kwargs)
        return

    def record(op: Any, seconds: float) -> None:
        timer[op.kind].append(seconds)

    options = VocabScheduleOptions(
        groups=env["groups"], num_barriers=1, layers_per_stage=(env["layers_per_stage"],) * PP,
        pass_timer=record)
    make_vocab_parallel_schedule(options)(forward_step_func=block_forward_step, **kwargs)


def _measure_one(env: dict[str, Any], vocab: int, mode: str) -> dict[str, Any]:
    import gc

    import torch
    import torch.distributed as dist

    from megatron_ext.runtime.vocab.profiling import (
        LiveTensorTracker,
        optimizer_state_tensors,
    )

    model, optimizer = _build(env, vocab, mode)
    busy, wall, timer = [], [], defaultdict(list)
    for it in range(1 + env["iterations"]):  # the first one warms up and creates Adam states
        timer.clear()
        dist.barrier()
        wall_start, cpu_start = time.perf_counter(), time.thread_time()
        _iteration(env, model, mode, timer)
        cpu, elapsed = time.thread_time() - cpu_start, time.perf_counter() - wall_start
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if it > 0:
            busy.append(cpu)
            wall.append(elapsed)
    passes = {kind: sum(v) / len(v) for kind, v in timer.items()}  # last iteration, per pass
    passes["busy"] = busy[-1]
    passes["count"] = {kind: len(v) for kind, v in timer.items()}
    gc.collect()
    tracker = LiveTensorTracker()
    tracker.register(list(model.parameters()) + [p.grad for p in model.parameters()]
                     + optimizer_state_tensors(optimizer))
    static = tracker.live_bytes
    with tracker:
        _iteration(env, model, mode, defaultdict(list))
    peak = torch.tensor([tracker.peak_bytes], dtype=torch.float64)
    wall_max = torch.tensor([sum(wall) / len(wall)])
    dist.all_reduce(wall_max, op=dist.ReduceOp.MAX)
    optimizer.zero_grad(set_to_none=False)
    return {"vocab": vocab, "mode": mode, "stage": env["stage"],
            "busy_s": min(busy), "wall_s": float(wall_max),
            "peak_bytes": float(peak), "static_bytes": float(static), "passes_s": passes}


def measure_rank(rank: int, world_size: int, **cfg: Any) -> list[dict[str, Any]]:
    """Spawned rank: every (vocabulary, layout) run on this pipeline stage."""
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.megatron_adapter.cpu import compat as cpu_compat
    from megatron_ext.runtime.vocab.comm import new_vocab_comm_groups

    cpu_compat.apply()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP,
                                             distributed_timeout_minutes=5)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=cfg["layers_per_stage"] * PP, hidden_size=cfg["hidden"],
        num_attention_heads=cfg["heads"], hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_model_parallel_size=PP, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, deallocate_pipeline_outputs=True)
    groups = new_vocab_comm_groups([list(range(world_size))], last_stage_root=PP - 1,
                                   first_stage_root=0)
    results = []
    for vocab in cfg["vocabs"]:
        gen = torch.Generator().manual_seed(vocab)
        data = [{"tokens": torch.randint(0, vocab, (cfg["mbs"], cfg["seq"]), generator=gen),
                 "labels": torch.randint(0, vocab, (cfg["mbs"], cfg["seq"]), generator=gen),
                 "loss_mask": torch.ones(cfg["mbs"], cfg["seq"])}
                for _ in range(cfg["microbatches"])]
        env = dict(cfg, config=config, groups=groups, data=data,
                   stage=parallel_state.get_pipeline_model_parallel_rank())
        for mode in ("baseline", "vocab_parallel"):
            results.append(_measure_one(env, vocab, mode))
    parallel_state.destroy_model_parallel()
    return results


# ---- part 1 analysis: imbalance and simulated iteration time ------------------------------------


def _simulated_iteration_s(rows: list[dict[str, Any]], cfg: dict[str, Any]) -> float:
    """Replay the measured per-pass CPU times through the pipeline simulation (no comm)."""
    from megatron_ext.geometry.vocab_partition import VocabPartition
    from megatron_ext.planner.vocab.pass_costs import vocab_pass_costs
    from megatron_ext.planner.vocab.schedule_plan import plan_vocab_schedule
    from megatron_ext.planner.vocab.schedule_sim import PassCosts, simulate, simulate_baseline

    rows = sorted(rows, key=lambda r: r["stage"])
    m, passes = cfg["microbatches"], [r["passes_s"] for r in rows]
    forward = tuple(p["F"] for p in passes)
    if rows[0]["mode"] == "baseline":  # backward = the rest of the stage's busy time
        backward = tuple(max(p["busy"] / m - p["F"], 0.0) for p in passes)
        return simulate_baseline(PP, m, PassCosts(forward_s=forward, backward_s=backward)
                                 ).makespan_s

    def mean(kind: str) -> float:
        values = [p[kind] for p in passes if kind in p]
        return sum(values) / len(values)

    measured = PassCosts(forward_s=forward, backward_s=tuple(p["B"] for p in passes),
                         output_forward_s=mean("S"), output_backward_s=mean("T"),
                         loss_s=mean("L"), input_forward_s=mean("IF"), input_backward_s=mean("IB"))
    hidden, seq, tokens = cfg["hidden"], cfg["seq"], cfg["seq"] * cfg["mbs"]
    padded = VocabPartition.create(rows[0]["vocab"], PP).padded_vocab_size
    placed = vocab_pass_costs(layers_per_stage=(cfg["layers_per_stage"],) * PP, hidden=hidden,
                              ffn_hidden=4 * hidden, seq_length=seq, tokens=tokens,
                              padded_vocab=padded, num_shards=PP, num_barriers=1)
    plan = plan_vocab_schedule(PP, m, num_barriers=1, costs=placed)  # the order that ran
    return simulate([plan.order(r) for r in range(PP)], measured, num_barriers=1).makespan_s


def summarise(results: list[dict[str, Any]], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    groups: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for row in results:
        groups[(row["vocab"], row["mode"])].append(row)
    out = []
    for (vocab, mode), rows in sorted(groups.items()):
        rows.sort(key=lambda r: r["stage"])
        busy, peak = [r["busy_s"] for r in rows], [r["peak_bytes"] for r in rows]
        out.append({
            "vocab": vocab, "mode": mode,
            "stage_busy_s": [round(b, 4) for b in busy],
            "stage_peak_mib": [round(p / MIB, 1) for p in peak],
            "stage_static_mib": [round(r["static_bytes"] / MIB, 1) for r in rows],
            "stage_time_imbalance": round(max(busy) / min(busy), 3),
            "stage_memory_imbalance": round(max(peak) / min(peak), 3),
            "iteration_wall_s": round(rows[0]["wall_s"], 3),
            "iteration_simulated_s": round(_simulated_iteration_s(rows, cfg), 4),
            "stage_pass_ms": [{k: round(1e3 * v, 2) for k, v in r["passes_s"].items()
                               if k not in ("busy", "count")} for r in rows],
        })
    return out


# ---- part 2: paper scale ----------------------------------------------------------------------

PAPER_TABLE5 = {  # (gpus, seq) -> MFU % for V = 32k/64k/128k/256k (arXiv v1, Table 5)
    (8, 2048): {"baseline": (46.16, 40.48, 33.11, 25.23), "redis": (46.01, 46.37, 44.22, 38.91),
                "vocab_parallel": (50.23, 50.18, 49.82, 49.69)},
    (8, 4096): {"baseline": (47.05, 41.87, 35.00, 26.75), "redis": (46.93, 46.78, 47.44, 43.01),
                "vocab_parallel": (50.93, 50.75, 50.56, 50.40)},
    (32, 2048): {"baseline": (42.81, 37.28, 28.97, 20.86), "redis": (43.48, 37.29, 36.32, 29.16),
                 "vocab_parallel": (45.54, 45.86, 45.86, 46.16)},
    (32, 4096): {"baseline": (43.68, 38.11, 30.05, 21.63), "redis": (44.01, 38.12, 37.87, 31.03),
                 "vocab_parallel": (46.23, 46.35, 46.55, 46.84)},
}
PAPER_VOCABS = (32_000, 64_000, 128_000, 256_000)
PAPER_MODELS = {8: (32, 3072, 24), 32: (64, 5120, 40)}  # gpus -> (layers, hidden, heads)


def _even_stages(num_layers: int, pp: int, last: int | None = None) -> list[tuple[int, int]]:
    """Contiguous stages; `last` layers on the last stage, the rest spread evenly."""
    last = num_layers // pp if last is None else last
    rest, sizes = num_layers - last, []
    for k in range(pp - 1):
        sizes.append(rest // (pp - 1) + (1 if k < rest % (pp - 1) else 0))
    sizes.append(last)
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def cost_model_gains(gpus: int, seq: int, vocab: int) -> dict[str, float]:
    """Search cost model (planner/cost/evaluate.py): pp = gpus, tp = dp = 1, 128 x mbs 1."""
    from megatron_ext.plan import LayerStrategy, PlanLayout, VocabStrategy
    from megatron_ext.planner.cost.evaluate import evaluate
    from megatron_ext.planner.cost.model import CostModel
    from megatron_ext.planner.training import TrainingSpec
    from megatron_ext.presets import cluster_preset
    from megatron_ext.specs import ModelSpec

    layers, hidden, heads = PAPER_MODELS[gpus]
    model = ModelSpec(name=f"paper-{gpus}gpu", num_layers=layers, hidden_size=hidden,
                      ffn_hidden_size=4 * hidden, num_attention_heads=heads,
                      num_query_groups=heads, vocab_size=vocab, activation="gelu",
                      normalization="LayerNorm", position_embedding="rope",
                      max_position_embeddings=seq)
    cm = CostModel(model, cluster_preset("dgx-a100-80g", num_nodes=gpus // 8),
                   TrainingSpec(global_batch_size=128, seq_length=seq, dropout=False))
    strategies = [LayerStrategy(dp=1)] * layers

    def iteration_s(stages: list[tuple[int, int]], mode: str) -> float:
        vocab_strategy = VocabStrategy(mode=mode, algorithm=1)  # type: ignore[arg-type]
        return evaluate(cm, PlanLayout(pp=gpus, stages=stages, layers=strategies,
                                       vocab=vocab_strategy, micro_batch_size=1)).iteration_s

    base = iteration_s(_even_stages(layers, gpus), "tp")
    # layer redistribution: 0 .. L/p layers on the last stage (the paper's "redis" goes to 0)
    redis = min(iteration_s(_even_stages(layers, gpus, last), "tp")
                for last in range(layers // gpus + 1))
    vp = iteration_s(_even_stages(layers, gpus), "vocab_parallel")
    return {"gain_vs_baseline": base / vp - 1, "gain_vs_redis": redis / vp - 1}


PAPER_SCALING_EFFICIENCY = {  # (gpus, seq) -> (output layer, input layer), paper Table 3, Vocab-2
    (8, 2048): (0.867, 0.40), (8, 4096): (0.884, 0.28),
    (32, 2048): (0.759, 0.15), (32, 4096): (0.797, 0.08),
}


def simulation_gains(gpus: int, seq: int, vocab: int, *, calibrated: bool,
                     efficiency: float = 0.5) -> dict[str, float]:
    """Pass-level simulation (runtime/vocab: cost.py + schedule_plan/sim) with A100 bf16 peak x
    `efficiency` for every pass and alpha-beta communication (NVLink in a node, 22 GB/s IB).
    `calibrated`: the vocabulary-parallel passes run at the paper's measured scaling efficiency
    of the sharded output / input layers (Table 3) instead of perfectly."""
    from megatron_ext.geometry.vocab_partition import VocabPartition
    from megatron_ext.planner.vocab.pass_costs import baseline_pass_costs, vocab_pass_costs
    from megatron_ext.planner.vocab.schedule_plan import plan_vocab_schedule
    from megatron_ext.planner.vocab.schedule_sim import simulate_baseline

    layers, hidden, _ = PAPER_MODELS[gpus]
    flops, m = 312e12 * efficiency, 128
    bandwidth = 230e9 if gpus <= 8 else 22e9
    comm_s = 2 * seq * hidden * 2 / bandwidth + 1e-5  # one [s, h] bf16 message, ring factor 2
    padded = VocabPartition.create(vocab, gpus, divisible_by=128).padded_vocab_size
    common = {"hidden": hidden, "ffn_hidden": 4 * hidden, "seq_length": seq, "tokens": seq,
              "padded_vocab": padded, "flops_per_s": flops}

    def baseline_s(last: int | None = None) -> float:
        sizes = [e - s for s, e in _even_stages(layers, gpus, last)]
        costs = baseline_pass_costs(layers_per_stage=tuple(sizes), comm_s=comm_s / 2, **common)
        return simulate_baseline(gpus, m, costs).makespan_s

    costs = vocab_pass_costs(layers_per_stage=(layers // gpus,) * gpus, num_shards=gpus,
                             num_barriers=1, comm_s=comm_s, **common)
    if calibrated:
        out_eff, in_eff = PAPER_SCALING_EFFICIENCY[(gpus, seq)]
        costs = dataclasses.replace(
            costs, output_forward_s=costs.output_forward_s / out_eff,
            output_backward_s=costs.output_backward_s / out_eff,
            input_forward_s=costs.input_forward_s / in_eff,
            input_backward_s=costs.input_backward_s / in_eff)
    vp = plan_vocab_schedule(gpus, m, num_barriers=1, costs=costs, iterations=1).makespan_s
    base = baseline_s()
    redis = min(baseline_s(last) for last in range(layers // gpus + 1))
    return {"gain_vs_baseline": base / vp - 1, "gain_vs_redis": redis / vp - 1}


def paper_predictions(with_simulation: bool) -> list[dict[str, Any]]:
    rows = []
    for (gpus, seq), table in PAPER_TABLE5.items():
        for i, vocab in enumerate(PAPER_VOCABS):
            vp = table["vocab_parallel"][i]
            row = {"gpus": gpus, "seq": seq, "vocab": vocab,
                   "paper": {"gain_vs_baseline": vp / table["baseline"][i] - 1,
                             "gain_vs_redis": vp / table["redis"][i] - 1},
                   "cost_model": cost_model_gains(gpus, seq, vocab)}
            if with_simulation:
                row["simulation"] = simulation_gains(gpus, seq, vocab, calibrated=False)
                row["simulation_calibrated"] = simulation_gains(gpus, seq, vocab,
                                                                calibrated=True)
            rows.append(row)
    return rows


# ---- CLI ----------------------------------------------------------------------------------------


def _print_measured(rows: list[dict[str, Any]]) -> None:
    print("vocab    layout          stage busy s (0..3)          max/min  "
          "stage peak MiB (0..3)            max/min  iter wall s  iter sim s", file=sys.stderr)
    for r in rows:
        busy = " ".join(f"{b:6.3f}" for b in r["stage_busy_s"])
        peak = " ".join(f"{p:7.1f}" for p in r["stage_peak_mib"])
        print(f"{r['vocab']:<8} {r['mode']:<15} {busy}  {r['stage_time_imbalance']:7.2f}  "
              f"{peak}  {r['stage_memory_imbalance']:7.2f}  {r['iteration_wall_s']:11.2f}  "
              f"{r['iteration_simulated_s']:10.3f}", file=sys.stderr)


_SOURCES = ("paper", "cost_model", "simulation", "simulation_calibrated")


def _print_predicted(rows: list[dict[str, Any]]) -> None:
    print("\ngain = vocabulary-parallel throughput / other - 1; columns: paper (Table 5, Vocab-2) "
          "/ search cost model / pass simulation / pass simulation at the paper's measured\n"
          "vocabulary-layer scaling efficiency (Table 3)", file=sys.stderr)
    print("gpus seq   vocab    gain vs baseline                       "
          "gain vs layer redistribution", file=sys.stderr)
    def cell(r: dict[str, Any], key: str) -> str:
        values = [r[src][key] for src in _SOURCES if src in r]
        return " / ".join(f"{100 * v:5.1f}%" for v in values)

    for r in rows:
        print(f"{r['gpus']:<4} {r['seq']:<5} {r['vocab']:<8} {cell(r, 'gain_vs_baseline'):<38}"
              f"   {cell(r, 'gain_vs_redis')}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32_000, 64_000, 128_000])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=3, help="timed, after one warm-up")
    parser.add_argument("--skip-measure", action="store_true", help="paper-scale part only")
    parser.add_argument("--no-simulation", action="store_true",
                        help="paper scale: cost model only (the simulation takes ~1 min)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    for name in ("hidden", "heads", "layers_per_stage", "seq", "micro_batch_size",
                 "microbatches", "iterations"):
        if getattr(args, name) < 1:
            print(f"bench_vocab: --{name.replace('_', '-')}={getattr(args, name)} must be >= 1",
                  file=sys.stderr)
            return 2
    cfg = {"vocabs": args.vocab, "hidden": args.hidden, "heads": args.heads,
           "layers_per_stage": args.layers_per_stage, "seq": args.seq,
           "mbs": args.micro_batch_size, "microbatches": args.microbatches,
           "iterations": args.iterations}
    report: dict[str, Any] = {"config": dict(cfg, pp=PP, precision="fp32", num_barriers=1)}
    if not args.skip_measure:
        from megatron_ext.runtime.testing import run_distributed

        start = time.perf_counter()
        per_rank = run_distributed(measure_rank, world_size=PP, timeout_s=3600,
                                   collective_timeout_s=600, **cfg)
        report["measured"] = summarise([row for rows in per_rank for row in rows], cfg)
        report["measure_wall_s"] = round(time.perf_counter() - start, 1)
        _print_measured(report["measured"])
        at = {r["mode"]: r for r in report["measured"] if r["vocab"] == max(args.vocab)}
        report["summary"] = {
            "vocab": max(args.vocab),
            "stage_time_imbalance": {m: at[m]["stage_time_imbalance"] for m in at},
            "stage_memory_imbalance": {m: at[m]["stage_memory_imbalance"] for m in at},
            "iteration_simulated_s": {m: at[m]["iteration_simulated_s"] for m in at},
        }
    report["predicted"] = paper_predictions(with_simulation=not args.no_simulation)
    _print_predicted(report["predicted"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    install_warning_filters()
    sys.exit(main())
