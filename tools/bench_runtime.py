"""Runtime overhead benchmark: a uniform plan through `build_model`/`train_step` against plain
megatron-core (`initialize_model_parallel`, stock `GPTModel`, `DistributedDataParallel`,
`get_megatron_optimizer`, `finalize_model_grads`, its own schedule) on the same gloo ranks, plus
step times of heterogeneous plans.

    python tools/bench_runtime.py [--world-size 4] [--steps 10] [--uniform-only]
        [--plan PLAN.json ...] [--json bench_runtime.json]
    python tools/bench_runtime.py --memory [--json bench_memory.json]

Both systems run in the same processes, steps interleaved in alternating order so machine load
hits both alike. A step's time is the slowest rank's; each system's time is the median
over steps (the minimum is reported too). `overhead_ratio_uniform` = median over rounds of
ours / plain for the uniform plan, each ratio from two adjacent steps (same model, data,
per-token loss, AdamW, clip 1.0); beside it the ratio of the two medians and the ratio of CPU
time summed over ranks (`overhead_ratio_uniform_cpu`), which waiting on a loaded machine does
not inflate. "CPU ms" is that sum. `--plan FILE` (repeatable) adds a plan file, e.g. one
written by `megatron-ext search`, run unchanged on its own model, batch and sequence length (its
world_size must equal --world-size). Prints a table to stderr and
writes JSON {summary: {overhead_ratio_uniform, ...}, plans: [...], setup: {...}}.

`--memory`: per-rank model-state memory (parameters + gradients + optimizer states) of layers at
ZeRO 0/1/2/3 in one model (4 ranks: tp1 dp4 layers, then tp2 dp2 layers; fp32 and bf16),
measured on the live tensors (`megatron_adapter/state_memory.py`) after the forward of the last
micro-batch of the second step, against the cost model's `state_bytes_per_param` times the
layer's parameters per GPU (the planner's own count, `layer_params / tp`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_ext.errors import PlanError
from megatron_ext.plan import LayerStrategy as L
from megatron_ext.plan import ParallelPlan, VocabStrategy
from megatron_ext.runtime.testing import run_distributed
from megatron_ext.specs import ModelSpec
from megatron_ext.warning_filters import install as install_warning_filters

BENCH_MODEL = ModelSpec(
    name="bench-llama", num_layers=4, hidden_size=256, ffn_hidden_size=704,
    num_attention_heads=8, num_query_groups=4, vocab_size=2048, max_position_embeddings=512,
)
SEQ, MBS, NUM_MB = 128, 8, 2
UNIFORM = [L(tp=2, sp=True, dp=2)] * 4


def make_plan(layers: list[L], *, world: int, pp: int = 1, stages=None, vtp: int = 2
              ) -> ParallelPlan:
    n = len(layers)
    stages = stages or tuple((i * n // pp, (i + 1) * n // pp) for i in range(pp))
    return ParallelPlan(world_size=world, pp=pp, stages=tuple(stages), layers=tuple(layers),
                        model=BENCH_MODEL, micro_batch_size=MBS, global_batch_size=MBS * NUM_MB,
                        seq_length=SEQ, precision="fp32", vocab=VocabStrategy(tp=vtp))


def hetero_plans(world: int) -> dict[str, ParallelPlan]:
    if world != 4:
        return {}
    return {
        "tp1/dp4 <-> tp2/dp2 alternating": make_plan([L(dp=4), L(tp=2, dp=2)] * 2, world=4),
        "tp4, tp2+sp, tp1": make_plan([L(tp=4), L(tp=2, sp=True, dp=2), L(dp=4), L(tp=4)],
                                      world=4),
        "mixed recompute": make_plan([L(tp=2, sp=True, dp=2, recompute=r) for r in
                                      ("selective", "full", "none", "none")], world=4),
        "zero-1 on half": make_plan([L(dp=4, zero=1)] * 2 + [L(tp=2, dp=2)] * 2, world=4),
        "cp2 + ulysses2": make_plan([L(cp=2, dp=2), L(tp=2, dp=2), L(ulysses=2, dp=2),
                                     L(tp=2, cp=2)], world=4),
        "pp2 3+1, tp2 | dp2": make_plan([L(tp=2)] * 3 + [L(dp=2)], world=4, pp=2,
                                        stages=[(0, 3), (3, 4)]),
    }


def batches(plan: ParallelPlan, seed: int = 0) -> list[dict]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(plan.num_microbatches):
        ids = torch.randint(0, plan.model.vocab_size, (plan.micro_batch_size,
                                                       plan.seq_length + 1), generator=gen)
        out.append({"tokens": ids[:, :-1], "labels": ids[:, 1:],
                    "loss_mask": torch.ones(plan.micro_batch_size, plan.seq_length)})
    return out


def opt_config():
    import torch
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0,
                           params_dtype=torch.float32)


def plain_megatron(plan: ParallelPlan):
    """Stock megatron-core for a uniform plan; returns a step function."""
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    from megatron_ext.geometry.vocab_partition import padded_vocab_size
    from megatron_ext.megatron_adapter.cpu import compat as cpu_compat
    from megatron_ext.megatron_adapter.sp_norm import gpt_block_spec
    from megatron_ext.megatron_adapter.transformer_config import transformer_config

    strategy = plan.layers[0]
    cpu_compat.apply()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=strategy.tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = transformer_config(plan.model, precision="fp32",
                                tensor_model_parallel_size=strategy.tp,
                                sequence_parallel=strategy.sp, calculate_per_token_loss=True)
    model = GPTModel(config=config, transformer_layer_spec=gpt_block_spec(config, pp_rank=0),
                     vocab_size=padded_vocab_size(plan.model.vocab_size, strategy.tp),
                     max_sequence_length=plan.model.max_position_embeddings,
                     position_embedding_type="rope")
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(opt_config(), [ddp])
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    dp_rank = parallel_state.get_data_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        part = slice(dp_rank * MBS // dp, (dp_rank + 1) * MBS // dp)  # this replica's samples
        loss = model(batch["tokens"][part], None, None, labels=batch["labels"][part])

        def loss_func(output):
            mask = batch["loss_mask"][part]
            total = (output * mask).sum()
            count = mask.sum()
            return total, count.to(torch.int), {"lm loss": torch.stack([total, count]).detach()}
        return loss, loss_func

    def step(micro: list[dict]) -> None:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp],
            num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=MBS // dp)
        # Megatron-LM's train_step reduces the reported loss over dp_cp every step; so do we.
        totals = torch.stack([r["lm loss"] for r in reports]).sum(0)
        torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group(
            with_context_parallel=True))
        optimizer.step()
    return step


def ours(plan: ParallelPlan):
    from megatron_ext.megatron_adapter.build import build_model
    from megatron_ext.megatron_adapter.optimizer import build_optimizer
    from megatron_ext.megatron_adapter.training.loop import train_step
    from megatron_ext.megatron_adapter.training.select import backend_for_model

    chunks, groups = build_model(plan)
    backend = backend_for_model(chunks, groups, build_optimizer(chunks, opt_config()))
    return lambda micro: train_step(backend, iter([backend.shard.rows(b) for b in micro]))


def _timed(step, micro: list[dict]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one step."""
    import torch.distributed as dist

    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    step(micro)
    return time.perf_counter() - start, time.process_time() - cpu


def bench_rank(rank: int, world_size: int, *, steps: int, warmup: int, hetero: bool,
               plan_files: dict[str, ParallelPlan]) -> dict:
    warnings.filterwarnings("ignore")
    uniform = make_plan(UNIFORM, world=world_size)
    runs = {"plain megatron-core (uniform)": plain_megatron(uniform),
            "megatron_ext (uniform)": ours(uniform)}
    if hetero:
        runs.update({name: ours(plan) for name, plan in hetero_plans(world_size).items()})
    runs.update({name: ours(plan) for name, plan in plan_files.items()})
    micro = {name: batches(plan_files.get(name, uniform)) for name in runs}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    order = list(runs)
    for i in range(warmup + steps):
        for name in order if i % 2 else order[::-1]:  # interleaved, alternating order
            elapsed = _timed(runs[name], micro[name])
            if i >= warmup:
                times[name].append(elapsed)
    return times


def summarize(per_rank: list[dict], world: int, steps: int) -> dict:
    def wall(name: str, i: int) -> float:  # a step's time is the slowest rank's
        return max(rank[name][i][0] for rank in per_rank)

    def cpu(name: str, i: int) -> float:  # CPU seconds of all ranks: insensitive to waiting
        return sum(rank[name][i][1] for rank in per_rank)

    plans = []
    for name in per_rank[0]:
        walls = [wall(name, i) for i in range(steps)]
        plans.append({"name": name, "step_ms_median": 1e3 * statistics.median(walls),
                      "step_ms_min": 1e3 * min(walls),
                      "cpu_ms_median": 1e3 * statistics.median(cpu(name, i)
                                                               for i in range(steps))})
    by_name = {p["name"]: p for p in plans}
    base, mine = "plain megatron-core (uniform)", "megatron_ext (uniform)"
    paired = [wall(mine, i) / wall(base, i) for i in range(steps)]
    paired_cpu = [cpu(mine, i) / cpu(base, i) for i in range(steps)]
    return {
        "summary": {
            "overhead_ratio_uniform": statistics.median(paired),
            "overhead_ratio_uniform_of_medians": (by_name[mine]["step_ms_median"]
                                                  / by_name[base]["step_ms_median"]),
            "overhead_ratio_uniform_cpu": statistics.median(paired_cpu),
            "uniform_plan": "tp2+sp dp2 x 4 layers",
        },
        "plans": plans,
        "setup": {"world_size": world, "steps": steps, "model": BENCH_MODEL.to_dict(),
                  "seq_length": SEQ, "micro_batch_size": MBS, "num_microbatches": NUM_MB,
                  "host": platform.node(), "processor": platform.processor()},
    }


def memory_plans() -> dict[str, ParallelPlan]:
    """One layer per ZeRO level, each its own gradient class (the vocabulary layers' tp differs
    from the layers', so they class apart)."""
    import dataclasses

    out = {}
    for precision in ("fp32", "bf16"):
        for tp, vtp in ((1, 2), (2, 1)):
            plan = make_plan([L(tp=tp, dp=4 // tp, zero=z) for z in (0, 1, 2, 3)], world=4,
                             vtp=vtp)
            out[f"tp{tp} dp{4 // tp} {precision}"] = dataclasses.replace(plan,
                                                                        precision=precision)
    return out


def memory_rank(rank: int, world_size: int) -> dict:
    """Per plan and layer class: measured bytes on this rank."""
    warnings.filterwarnings("ignore")
    import dataclasses

    import torch
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_ext.megatron_adapter.build import build_model
    from megatron_ext.megatron_adapter.losses import layerwise_forward_step
    from megatron_ext.megatron_adapter.optimizer import build_optimizer
    from megatron_ext.megatron_adapter.state_memory import class_state_bytes
    from megatron_ext.megatron_adapter.training.loop import train_step
    from megatron_ext.megatron_adapter.training.select import backend_for_model

    out = {}
    for name, plan in memory_plans().items():
        half = plan.precision == "bf16"
        # Megatron-LM reduces bf16 gradients in fp32 unless --grad-reduce-in-bf16.
        chunks, groups = build_model(plan, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=half))
        config = dataclasses.replace(opt_config(), bf16=half, params_dtype=torch.bfloat16
                                     if half else torch.float32)
        optimizer = build_optimizer(chunks, config)
        seen: list = []

        def probe(data_iterator, model, seen=seen, chunks=chunks, optimizer=optimizer,
                  plan=plan, name=name):
            result = layerwise_forward_step(data_iterator, model)
            seen.append(None)
            if len(seen) == 2 * plan.num_microbatches:  # last micro-batch of step 2
                out[name] = class_state_bytes(chunks[0], optimizer)
            return result

        backend = backend_for_model(chunks, groups, optimizer, forward_step_func=probe)
        for _ in range(2):
            train_step(backend, iter([backend.shard.rows(b) for b in batches(plan)]))
    return out


def memory_report(per_rank: list[dict]) -> dict:
    from megatron_ext.planner.cost.compute import layer_params
    from megatron_ext.planner.cost.memory import state_bytes_per_param

    rows = []
    for name, plan in memory_plans().items():
        for i, cls in enumerate(per_rank[0][name]):
            if not all(m.endswith("TransformerLayer") for m in cls["modules"]):
                continue  # the vocabulary layers' classes
            measured = [r[name][i] for r in per_rank]
            total = max(m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]
                        for m in measured)
            d = 4 // cls["tp"]
            per_param = state_bytes_per_param(cls["zero"], d,
                                              half_precision=plan.precision != "fp32")
            predicted = layer_params(plan.model) / cls["tp"] * per_param
            rows.append({"plan": name, "zero": cls["zero"], "tp": cls["tp"], "d": d,
                         "measured_bytes": total, "predicted_bytes": predicted,
                         "ratio": total / predicted,
                         "param_bytes": measured[0]["param_bytes"],
                         "grad_bytes": measured[0]["grad_bytes"],
                         "optimizer_bytes": measured[0]["optimizer_bytes"],
                         "layer_numel_per_gpu": cls["numel"]})
    return {"rows": rows, "max_abs_error": max(abs(r["ratio"] - 1) for r in rows),
            "setup": {"model": BENCH_MODEL.to_dict(), "world_size": 4, "point": "after the "
                      "forward of the last micro-batch of step 2", "host": platform.node()}}


def print_memory(report: dict) -> None:
    print(f"{'plan':16s} {'zero':>4s} {'d':>2s} {'params MiB':>10s} {'grads MiB':>9s} "
          f"{'optim MiB':>9s} {'measured':>9s} {'predicted':>9s} {'ratio':>6s}", file=sys.stderr)
    mib = 2.0 ** 20
    for r in report["rows"]:
        print(f"{r['plan']:16s} {r['zero']:4d} {r['d']:2d} {r['param_bytes'] / mib:10.3f} "
              f"{r['grad_bytes'] / mib:9.3f} {r['optimizer_bytes'] / mib:9.3f} "
              f"{r['measured_bytes'] / mib:9.3f} {r['predicted_bytes'] / mib:9.3f} "
              f"{r['ratio']:6.3f}", file=sys.stderr)
    print(f"max |measured / predicted - 1| = {report['max_abs_error']:.3f}", file=sys.stderr)


def load_plan_files(paths: list[Path], world_size: int) -> dict[str, ParallelPlan]:
    """Table name -> plan, checked against the world size before any process starts."""
    plans = {}
    for path in paths:
        plan = ParallelPlan.load(path)
        if plan.world_size != world_size:
            raise PlanError(f"--plan {path}: world_size={plan.world_size} differs from "
                            f"--world-size={world_size}; pass --world-size {plan.world_size}")
        plans[f"plan file {path.name}"] = plan
    return plans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--uniform-only", action="store_true",
                        help="only the overhead pair (more steps in the same time)")
    parser.add_argument("--plan", action="append", default=[], type=Path,
                        help="also time this plan file unchanged (repeatable)")
    parser.add_argument("--memory", action="store_true",
                        help="model-state memory per ZeRO level, measured vs predicted")
    args = parser.parse_args(argv)
    if args.memory:
        report = memory_report(run_distributed(memory_rank, world_size=4, timeout_s=1800))
        print_memory(report)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        return 0
    try:
        plan_files = load_plan_files(args.plan, args.world_size)
    except PlanError as err:
        print(f"bench_runtime.py: error: {err}", file=sys.stderr)
        return 2
    per_rank = run_distributed(bench_rank, world_size=args.world_size, timeout_s=3600,
                               steps=args.steps, warmup=args.warmup, hetero=not args.uniform_only,
                               plan_files=plan_files)
    report = summarize(per_rank, args.world_size, args.steps)
    report["setup"]["plan_files"] = {name: plan.to_dict() for name, plan in plan_files.items()}
    print(f"{'plan':42s} {'median ms':>10s} {'min ms':>10s} {'CPU ms':>10s}", file=sys.stderr)
    for p in report["plans"]:
        print(f"{p['name']:42s} {p['step_ms_median']:10.1f} {p['step_ms_min']:10.1f} "
              f"{p['cpu_ms_median']:10.1f}", file=sys.stderr)
    s = report["summary"]
    print(f"overhead_ratio_uniform {s['overhead_ratio_uniform']:.3f} (median of per-round "
          f"wall ratios), {s['overhead_ratio_uniform_of_medians']:.3f} (ratio of medians), "
          f"{s['overhead_ratio_uniform_cpu']:.3f} (CPU time)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    install_warning_filters()
    sys.exit(main())
