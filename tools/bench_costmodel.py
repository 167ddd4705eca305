"""Calibration benchmark of the cost model on this CPU machine: profile, predict, run, compare.

    python tools/bench_costmodel.py [--json bench_costmodel.json] [--world-size 4] [--quick]
        [--hog N]  # N busy-loop processes beside the whole benchmark (the load test)
        [--cluster-profile F --model-profile F]  # reuse profiles instead of measuring

1. Profile the hardware (collective curves, overlap, compute slots of `world_size` gloo ranks)
   and a small GPT (its megatron-core layer at tp 1/2/4, vocabulary layers, optimizer).
   Model profile: every shape by one process alone, then the slowdown of `world_size`
   processes running the layer stack at once (the ranks share 2 cores) against one alone.
2. Run each plan in `bench_costmodel_runs.bench_plans()` for real with the runtime
   (`build_model` + `train_step`, megatron-core 1F1B, overlapped gradient reduction), plans
   round-robin; a step's time is the slowest rank's, a plan's measured time its fastest step
   (least disturbed by other processes on a shared machine, as the profilers keep their fastest
   repeat); the median is reported too. Right before and after every plan's steps the ranks
   probe the machine with the model profiler's own sharing workload (its layer stack, one rank
   alone, then all at once: `SharingProbe`).
3. Predict each plan with the profile-fed cost model (`ProfiledCostModel`: measured curves and
   layer fits, the 1F1B schedule simulated on the measured compute slots,
   megatron_ext/planner/profile/pipeline.py) on the profile re-expressed at the machine state
   its probes saw (planner/profile/load.py: solo times scaled by the probe's alone time against
   the profiler's, sharing slowdown = the probe's). A CPU hog or other users' work beside the
   runs changes how 4 ranks share 2 cores; the probes put that change into the prediction
   instead of into the error. Nothing is fitted to the timed runs: the probe is a fixed
   workload, the same for every plan. For comparison the plan is also predicted on the profile
   as measured ("at profile", what this benchmark reported before the probes, --no-probe) and
   with the analytic cost model on the profile's ClusterSpec.
4. Report per plan predicted, measured and error; overall median absolute relative error, the
   signed bias (median of predicted / measured - 1: a machine where every plan comes out fast
   shows it at once) and Spearman rank correlation, with one line of machine facts (CPU model,
   cores, frequency governor where exposed, load average). JSON top level: `summary`
   {median_abs_error, median_signed_error, spearman, num_plans} (probed),
   `profile_time_summary`, `analytic_summary`, `machine`.
5. --pieces N: after the timed steps, N more steps per plan with their pieces timed on every
   rank (zero-grad, megatron-core's forward_step and backward_step, finalize_model_grads, the
   optimizer step; CPU seconds and page faults) beside what the cost model assigns to each
   (`model_pieces`): where a prediction misses, the table says which piece.

Load (megatron_ext/calibration/load_check.py): before the first round, after each phase
of each round and at the end, the 1-minute load average and a fixed single-process reference
loop are recorded (`load` in the JSON, a table on stdout). When the slowest reference loop
exceeds the fastest by more than --max-load-swing (default 1.5x) the benchmark prints the plan
table marked as not comparable, writes `summary: null`, and exits 4 (--report-anyway reports
regardless): the probes follow the compute side of a load change, not the collective curves
profiled before it.

--quick: one round and one model-profiler repeat instead of two of each, with twice the steps
in that round (same plans and grid, as many timed steps per plan as the full run: a plan's
fastest step is the figure, and two samples of it moved by up to 20% on the 2-core machine; the
hardware profiler keeps at least HARDWARE_REPEATS samples per collective): about 6 minutes on
the 2-core machine with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_costmodel_runs import (
    BENCH_MODEL,
    GLOBAL_BATCH,
    SEQ_LENGTH,
    bench_plans,
    fastest_cluster,
    fastest_model,
    measure_rank,
    profile_hardware_rank,
)

from megatron_ext.calibration.load_check import LoadLog, machine_facts, machine_line
from megatron_ext.megatron_adapter.profile_model import ProfileGrid, profile_model
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.cost.model import CostModel
from megatron_ext.planner.profile.cost import (
    ProfiledCostModel,
    predict_iteration_s,
    stage_work,
)
from megatron_ext.planner.profile.load import ProbeReading, at_machine_state, machine_state
from megatron_ext.planner.profile.profiles import ClusterProfile, ModelProfile
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.runtime.testing import run_distributed
from megatron_ext.warning_filters import install as install_warning_filters

HARDWARE_REPEATS = 5
"""At least this many samples per collective size (the fastest is kept), whatever --repeats:
4 ranks on 2 cores wait for the scheduler, so one sample of a 4 KiB all-reduce reads 1-9 ms
where the fastest of 5 reads ~1 ms; collectives are cheap to repeat, the model profile is not."""


def profile_grid(args: argparse.Namespace) -> ProfileGrid:
    """Every per-replica micro-batch the plans run (1 .. 32): interpolated, not extrapolated.
    The run-time probes rebuild the sharing stack from this grid, so a reused --model-profile
    must have been taken with it."""
    return ProfileGrid(tps=(1, 2, 4), micro_batch_sizes=(1, 2, 4, 8, 16, 32),
                       seq_lengths=(SEQ_LENGTH // 2, SEQ_LENGTH), repeats=args.repeats)


def run_round(args: argparse.Namespace, timings: dict, load: LoadLog, index: int
              ) -> tuple[ClusterProfile | None, ModelProfile | None, list[dict] | None]:
    """One round: hardware profile, model profile, every plan measured once (each step skipped
    when its input was given), with a load checkpoint after each."""
    cluster = model = runs = None
    t0 = time.perf_counter()
    if not args.cluster_profile:
        out = run_distributed(profile_hardware_rank, world_size=args.world_size, timeout_s=1800,
                              collective_timeout_s=600, min_bytes=2**12, max_bytes=2**24,
                              repeats=max(args.repeats, HARDWARE_REPEATS))
        cluster = ClusterProfile.from_dict(out[0])
        load.checkpoint(f"round {index} after hardware profile")
    t1 = time.perf_counter()
    if not args.model_profile:
        model = profile_model(BENCH_MODEL, precision="fp32", grid=profile_grid(args),
                              concurrency=args.profile_concurrency or args.world_size,
                              threads=1)
        load.checkpoint(f"round {index} after model profile")
    t2 = time.perf_counter()
    if not args.reuse_measured:
        runs = run_distributed(measure_rank, world_size=args.world_size, timeout_s=3600,
                               collective_timeout_s=900,
                               plans=[pl.to_dict() for _, pl in bench_plans()], rounds=1,
                               steps=args.steps,
                               overlap_grad_reduce=not args.no_overlap_grad_reduce,
                               probe_grid=None if args.no_probe else profile_grid(args),
                               pieces=args.pieces if index == args.rounds else 0)[0]
        load.checkpoint(f"round {index} after runs")
    t3 = time.perf_counter()
    timings.setdefault("load_avg_1m_per_round", []).append(os.getloadavg()[0])
    for key, dt in (("profile_hardware_s", t1 - t0), ("profile_model_s", t2 - t1),
                    ("measure_s", t3 - t2)):
        timings[key] = timings.get(key, 0.0) + dt
    return cluster, model, runs


def collect(args: argparse.Namespace, load: LoadLog
            ) -> tuple[ClusterProfile, ModelProfile, list[dict], dict]:
    """`rounds` interleaved rounds of profiling and measuring, so both see the same spread of
    load from other processes; per quantity the least disturbed (fastest) round is kept."""
    timings: dict = {}
    load.checkpoint("start")
    rounds = [run_round(args, timings, load, i + 1) for i in range(args.rounds)]
    if args.cluster_profile:
        cluster = ClusterProfile.load(args.cluster_profile)
    else:
        cluster = fastest_cluster([r[0] for r in rounds])
    if args.model_profile:
        model = ModelProfile.load(args.model_profile)
    else:
        model = fastest_model([r[1] for r in rounds])
    if args.reuse_measured:
        old = {r["plan"]: r for r in json.loads(Path(args.reuse_measured).read_text())["plans"]}
        runs = [{k: old[name].get(k, []) if k == "probes" else old[name][k]
                 for k in ("measured_s", "median_s", "max_s", "loss", "probes")}
                for name, _ in bench_plans()]
    else:
        per_plan = list(zip(*(r[2] for r in rounds)))
        runs = [{"measured_s": min(r["measured_s"] for r in rs),
                 "median_s": statistics.median(r["median_s"] for r in rs),
                 "max_s": max(r["max_s"] for r in rs), "loss": rs[-1]["loss"],
                 "probes": [p for r in rs for p in r["probes"]],
                 **({"pieces": rs[-1]["pieces"]} if "pieces" in rs[-1] else {})}
                for rs in per_plan]
    if args.save_profiles:
        Path(args.save_profiles).mkdir(parents=True, exist_ok=True)
        cluster.save(Path(args.save_profiles) / "cluster_profile.json")
        model.save(Path(args.save_profiles) / "model_profile.json")
    return cluster, model, runs, timings


def predict(plan: ParallelPlan, cm: CostModel) -> float:
    return predict_iteration_s(cm, plan.layout)


def summarize(pred: list[float], meas: list[float]) -> dict[str, float]:
    """Median |error|, the signed bias (median of predicted / measured - 1: every plan predicted
    fast shows as a negative bias even when |error| looks small) and Spearman."""
    err = [(p - m) / m for p, m in zip(pred, meas)]
    return {"median_abs_error": float(statistics.median(abs(e) for e in err)),
            "median_signed_error": float(statistics.median(err)),
            "spearman": float(spearmanr(pred, meas).statistic), "num_plans": len(pred)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--cluster-profile", default=None, help="reuse this cluster profile")
    p.add_argument("--model-profile", default=None, help="reuse this model profile")
    p.add_argument("--save-profiles", default=None, help="directory to write both profiles to")
    p.add_argument("--repeats", type=int, default=2, help="profiler repeats per point per round")
    p.add_argument("--rounds", type=int, default=2,
                   help="interleaved rounds of profiling and measuring")
    p.add_argument("--steps", type=int, default=2, help="timed steps per plan per round")
    p.add_argument("--profile-concurrency", type=int, default=None,
                   help="ranks sharing the CPU for the model profiler's sharing measurement "
                   "(default: --world-size)")
    p.add_argument("--no-overlap-grad-reduce", action="store_true")
    p.add_argument("--reuse-measured", default=None,
                   help="take measured times from this earlier --json instead of running")
    p.add_argument("--max-load-swing", type=float, default=1.5,
                   help="refuse to report when the slowest reference loop exceeds the fastest "
                   "by more than this factor (default %(default)s)")
    p.add_argument("--report-anyway", action="store_true",
                   help="report the figures even when the load changed during the run")
    p.add_argument("--no-probe", action="store_true",
                   help="do not probe the machine beside the timed runs: predict every plan on "
                   "the profile as measured (the figures then move with the load)")
    p.add_argument("--quick", action="store_true",
                   help="one round, one profiler repeat, twice --steps in that round "
                   "(%(prog)s in about half the default time; same plans, same profile grid, "
                   "as many timed steps per plan)")
    p.add_argument("--pieces", type=int, default=0, metavar="N",
                   help="after the timed steps, run N more steps per plan with their pieces "
                   "timed (forward, backward, gradient sync, optimizer step, CPU seconds, page "
                   "faults) and print them beside the cost model's (default 0: off)")
    p.add_argument("--hog", type=int, default=0, metavar="N",
                   help="run N busy-loop processes (python: while True: pass) beside the whole "
                   "benchmark, profiling included: the load test (default 0)")
    args = p.parse_args(argv)
    if args.quick:  # as many timed steps per plan as the full run's 2 rounds x 2 steps
        args.rounds, args.repeats, args.steps = 1, 1, 2 * args.steps
    t_start = time.perf_counter()
    facts = machine_facts()
    print(machine_line(facts))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.hog)]
    try:
        load = LoadLog(max_swing=args.max_load_swing)
        cluster, model_prof, runs, timings = collect(args, load)
        load.checkpoint("end")
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    report = load.stable() or args.report_anyway
    training = TrainingSpec(global_batch_size=GLOBAL_BATCH, seq_length=SEQ_LENGTH,
                            precision="fp32", dropout=False, flash_attention=False,
                            overlap_grad_reduce=not args.no_overlap_grad_reduce)
    profiled = ProfiledCostModel(BENCH_MODEL, cluster.cluster, training, comm=cluster,
                                 model_profile=model_prof)
    analytic = CostModel(BENCH_MODEL, cluster.cluster, training)
    plans = bench_plans()
    rows = []
    for (name, plan), run in zip(plans, runs):
        at_profile, base = predict(plan, profiled), predict(plan, analytic)
        readings = [ProbeReading(**r) for r in run["probes"]]
        state = machine_state(readings, model_prof.sharing_alone_s) if readings else None
        cm = profiled if state is None else ProfiledCostModel(
            BENCH_MODEL, cluster.cluster, training, comm=cluster,
            model_profile=at_machine_state(model_prof, state))
        pred = at_profile if state is None else predict(plan, cm)
        if "pieces" in run:
            run["model_pieces"] = model_pieces(cm, plan)
        m = run["measured_s"]
        rows.append({"plan": name, "predicted_s": pred, "profile_time_s": at_profile,
                     "analytic_s": base, **run, "machine_state": state and asdict(state),
                     "error": (pred - m) / m, "profile_time_error": (at_profile - m) / m,
                     "analytic_error": (base - m) / m})
    meas = [r["measured_s"] for r in rows]
    summary = summarize([r["predicted_s"] for r in rows], meas)
    profile_time_summary = summarize([r["profile_time_s"] for r in rows], meas)
    analytic_summary = summarize([r["analytic_s"] for r in rows], meas)
    if args.hog:
        print(f"{args.hog} busy-loop process(es) ran beside the whole benchmark")
    print_table(rows, summary, profile_time_summary, analytic_summary, cluster, model_prof,
                report)
    if args.pieces:
        print(pieces_table(rows))
    print(load.table())
    print(load.verdict())
    timings["total_s"] = time.perf_counter() - t_start
    if args.json:
        Path(args.json).write_text(json.dumps({
            "summary": summary if report else None,
            "profile_time_summary": profile_time_summary if report else None,
            "analytic_summary": analytic_summary if report else None,
            "unreported_summary": None if report else summary,
            "load": load.to_dict(), "plans": rows,
            "overlap_slowdown": cluster.overlap_slowdown,
            "compute_slots_per_node": cluster.compute_slots_per_node,
            "sharing_slowdown": model_prof.sharing_slowdown,
            "sharing_alone_s": model_prof.sharing_alone_s,
            "probed": not args.no_probe, "quick": args.quick,
            "peak_flops_per_rank": cluster.cluster.peak_flops,
            "model_fit": {k: {"median_rel_error": a, "max_rel_error": b}
                          for k, (a, b) in model_prof.fit_report().items()},
            "timings_s": timings,
            "machine": {**facts, "platform": platform.platform(),
                        "load_avg_1m": os.getloadavg()[0]},
            "world_size": args.world_size, "model": BENCH_MODEL.to_dict(), "hog": args.hog,
        }, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if report else 4


def model_pieces(cm: CostModel, plan: ParallelPlan) -> dict[str, float]:
    """What the cost model assigns to the pieces `--pieces` times, for the stage whose
    forward + backward is longest: compute of one rank alone over all micro-batches, the
    communication exposed inside them, the gradient tail and the optimizer step (seconds of a
    rank alone), and the predicted step (sharing included)."""
    w = stage_work(cm, plan.layout)
    m = GLOBAL_BATCH // plan.micro_batch_size
    k = int(np.argmax(w.forward_compute_s + w.backward_compute_s))
    return {"forward_s": float(w.forward_compute_s[k]) * m,
            "backward_s": float(w.backward_compute_s[k]) * m,
            "comm_s": float(w.forward_comm_s[k] + w.backward_comm_s[k]) * m,
            "grad_sync_s": float(w.tail_comm_s[k]), "optimizer_s": float(w.optimizer_s[k]),
            "step_s": predict(plan, cm)}


def pieces_table(rows: list[dict]) -> str:
    """Per plan: the model's pieces (`model_pieces`, a rank alone) against the measured ones
    (median over ranks of each piece's wall seconds; CPU seconds and page faults per rank)."""
    head = (f"{'plan':<30}{'':>4}{'fwd s':>7}{'bwd s':>7}{'comm s':>7}{'sync s':>7}"
            f"{'opt s':>7}{'step s':>8}{'cpu s':>7}{'main':>7}{'faults':>8}")
    out = ["pieces: model = one rank alone on the stage with the longest compute (comm: exposed "
           "inside the passes), step with sharing; measured = median over ranks (wall; cpu s: "
           "all threads, main: the rank's main thread, the rest is gloo's)", head]
    for r in rows:
        if "pieces" not in r:
            continue
        mp, ranks = r["model_pieces"], r["pieces"]
        med = {k: statistics.median(x[k] for x in ranks) for k in ranks[0]}
        out.append(f"{r['plan']:<30}{'mod':>4}{mp['forward_s']:>7.3f}{mp['backward_s']:>7.3f}"
                   f"{mp['comm_s']:>7.3f}{mp['grad_sync_s']:>7.3f}{mp['optimizer_s']:>7.3f}"
                   f"{mp['step_s']:>8.3f}")
        out.append(f"{'':<30}{'run':>4}{med['forward_s']:>7.3f}{med['backward_s']:>7.3f}"
                   f"{'':>7}{med['grad_sync_s']:>7.3f}{med['optimizer_s']:>7.3f}"
                   f"{med['step_s']:>8.3f}{med['cpu_s']:>7.3f}{med['main_cpu_s']:>7.3f}"
                   f"{med['page_faults']:>8.0f}")
    return "\n".join(out)


def print_table(rows: list[dict], summary: dict, profile_time: dict, analytic: dict,
                cluster: ClusterProfile, model: ModelProfile, report: bool) -> None:
    alone = "not recorded" if model.sharing_alone_s is None else f"{model.sharing_alone_s:.3f} s"
    print(f"{cluster.device}, {cluster.backend} x {cluster.cluster.gpus_per_node} ranks: peak "
          f"{cluster.cluster.peak_flops / 1e9:.1f} GFLOP/s per rank, overlap slowdown "
          f"{cluster.overlap_slowdown:.2f}, {cluster.compute_slots_per_node} matmul slots; "
          f"model sharing slowdown {model.sharing_slowdown:.2f} x{model.concurrency} (stack "
          f"alone {alone}); model fit forward median error "
          f"{model.fit_report()['forward_s'][0]:.1%}")
    print("predicted = profile at the machine state probed beside the plan's run (solo factor,"
          " sharing slowdown); at profile = the profile as measured")
    print(f"{'plan':<30}{'solo':>6}{'share':>6}{'predicted s':>12}{'measured s':>11}"
          f"{'error':>8}{'at profile':>11}{'error':>8}{'analytic':>9}{'error':>8}")
    for r in rows:
        st = r["machine_state"]
        solo, share = (f"{st['solo_factor']:.2f}", f"{st['sharing_slowdown']:.2f}") if st else (
            "-", "-")
        print(f"{r['plan']:<30}{solo:>6}{share:>6}{r['predicted_s']:>12.3f}"
              f"{r['measured_s']:>11.3f}{r['error']:>+8.1%}{r['profile_time_s']:>11.3f}"
              f"{r['profile_time_error']:>+8.1%}{r['analytic_s']:>9.3f}"
              f"{r['analytic_error']:>+8.1%}")
    if not report:
        print("NOT COMPARABLE (load changed during the run, see below): no summary")
        return
    print(f"probed: median |error| {summary['median_abs_error']:.1%}, median signed error "
          f"{summary['median_signed_error']:+.1%}, Spearman {summary['spearman']:.3f} over "
          f"{summary['num_plans']} plans; at profile: {profile_time['median_abs_error']:.1%}, "
          f"{profile_time['median_signed_error']:+.1%}, {profile_time['spearman']:.3f}; "
          f"analytic: {analytic['median_abs_error']:.1%}, "
          f"{analytic['median_signed_error']:+.1%}, {analytic['spearman']:.3f}")
    print(f"measured step times span {min(r['measured_s'] for r in rows):.2f}-"
          f"{max(r['measured_s'] for r in rows):.2f} s; load average now "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    assert np.isfinite(summary["median_abs_error"])


if __name__ == "__main__":
    install_warning_filters()
    sys.exit(main())
