"""The published runs' benchmark as text: per-row predictions, rank groups, sweeps, per-model
summaries, the held-out refit and the totals (what tools/bench_published.py prints)."""

from __future__ import annotations

from typing import Any

from megatron_ext.calibration.ranking import BIG_SWEEP
from megatron_ext.calibration.vtrain import VTRAIN_SOURCES


def _sweep_cols(m: dict[str, Any]) -> str:
    """n, median rho, meeting, reference median rho, reference meeting (27 characters)."""
    if not m.get("big_sweeps"):
        return f"{0:3d} {'-':>5} {'-':>4} {'-':>5} {'-':>4}"
    return (f"{m['big_sweeps']:3d} {m['median_spearman']:5.2f} {m['meeting_targets']:4d} "
            f"{m['baseline_median_spearman']:5.2f} {m['baseline_meeting_targets']:4d}")


def print_report(out: dict[str, Any]) -> None:
    print(f"{'run':32} {'layout':34} {'meas s':>8} {'pred s':>8} {'pred/meas':>9} "
          f"{'mem GiB':>8} {'fits':>4}")
    for r in out["rows"]:
        if r["source"] in VTRAIN_SOURCES:
            continue
        print(f"{r['id']:32} {r['layout']:34} {r['measured_s']:8.2f} {r['predicted_s']:8.2f} "
              f"{r['ratio']:9.3f} {r['peak_gib']:8.1f} {'yes' if r['fits'] else 'NO':>4}")
    print()
    print(f"{'source':54} {'model':24} {'rows':>4} {'spearman':>8}")
    for g in out["rank_groups"]:
        if g["source"] in VTRAIN_SOURCES:
            continue
        print(f"{g['source'][:54]:54} {g['model'][:24]:24} {g['rows']:4d} {g['spearman']:8.3f}")
    print()
    held_sweeps = {(g["model"], g["cluster"], g["global_batch_size"], g["seq_len"]): g
                   for g in out["leave_one_source_out"].get("sweeps", [])}
    print(f"{'sweep (model, cluster [date], global batch, seq)':66} {'n':>3} {'spearman':>8} "
          f"{'top1 regret':>11} {'pairs ok':>8} {'held out: rho / regret':>22}")
    for g in out["sweeps"]:
        if g["source"] in VTRAIN_SOURCES:
            continue
        name = f"{g['model']}, {g['cluster']}, {g['global_batch_size']}, {g['seq_len']}"
        h = held_sweeps.get((g["model"], g["cluster"], g["global_batch_size"], g["seq_len"]))
        held = f"{h['spearman']:.3f} / {100 * h['top1_regret']:.1f}%" if h else "-"
        print(f"{name[:66]:66} {g['layouts']:3d} {g['spearman']:8.3f} "
              f"{100 * g['top1_regret']:10.1f}% {100 * g['pairs_ordered']:7.0f}% {held:>22}")
    if out["model_summaries"]:
        print()
        print(f"per model (every sweep in --json): sweeps of >= {BIG_SWEEP} layouts (n), median "
              "Spearman, how many meet rho >= 0.8 and top-1 regret <= 5%,")
        print("and the same for the reference predictor (micro-batch steps x layers per stage); "
              "sweeps as above (GPU counts together, per token) and at one GPU count")
        print(f"{'':63} | {'sweeps':^23} {'held':>5} | {'at one GPU count':^23}")
        cols = f"{'n':>3} {'rho':>5} {'meet':>4} {'ref':>5} {'meet':>4}"
        print(f"{'source':18} {'model':22} {'rows':>4} {'|err|':>5} {'pred/meas':>10} | "
              f"{cols} {'rho':>5} | {cols}")
        for m in out["model_summaries"]:
            held = m.get("held_out_median_spearman")
            print(f"{m['source'][:18]:18} {m['model'][:22]:22} {m['rows']:4d} "
                  f"{100 * m['median_abs_error']:4.0f}% "
                  f"{m['min_ratio']:4.2f}-{m['max_ratio']:<5.2f} | {_sweep_cols(m)} "
                  f"{'-' if held is None else f'{held:.2f}':>5} | "
                  f"{_sweep_cols(m['one_gpu_count'])}")
    print()
    print(f"sweeps of >= {BIG_SWEEP} layouts: n, median / min Spearman, meeting both targets; the "
          "reference predictor (micro-batch steps x layers per stage): median / min, meeting")
    summ = out["sweep_summary"]
    for label, (every, held_out, by_source) in (
            ("", ("all", "held_out", "by_source")),
            (" (at one GPU count)", ("one_gpu_count", "one_gpu_count_held_out",
                                     "one_gpu_count_by_source"))):
        groups = [(f"all sources{label}", summ[every]), (f"all, held out{label}", summ[held_out]),
                  *((f"{k}{label}", v) for k, v in summ[by_source].items())]
        for name, g in groups:
            if not g.get("big_sweeps"):
                continue
            print(f"  {name[:66]:66} {g['big_sweeps']:3d}  rho {g['median_spearman']:6.3f} / "
                  f"{g['min_spearman']:6.3f}  meet {g['meeting_targets']:3d}   reference "
                  f"{g['baseline_median_spearman']:6.3f} / {g['baseline_min_spearman']:6.3f}  "
                  f"meet {g['baseline_meeting_targets']:3d}")
    held = out["leave_one_source_out"]
    if held:
        print()
        print(f"{'held-out source (gemm_efficiency fitted on the others)':58} {'rows':>4} "
              f"{'eff':>5} {'|error|':>7} {'in 90%':>6}")
        for e in held["sources"]:
            print(f"{e['source'][:58]:58} {e['rows']:4d} {e['gemm_efficiency']:5.2f} "
                  f"{100 * e['median_abs_error']:6.1f}% {100 * e['interval_coverage']:5.0f}%")
        print(f"leave-one-source-out: median |error| {100 * held['median_abs_error']:.1f}%, "
              f"mean {100 * held['mean_abs_error']:.1f}%; 90% interval coverage on held-out "
              f"sources {100 * held['interval_coverage']:.0f}% (median width "
              f"{100 * held['interval_median_width']:.0f}% of the prediction)")
        for name, g in held["by_group"].items():
            print(f"  {name} ({g['rows']} rows): median |error| "
                  f"{100 * g['median_abs_error']:.1f}%, "
                  f"coverage {100 * g['interval_coverage']:.0f}%")
        worst = [g for g in held["sweeps"]]
        if worst:
            print(f"held-out sweeps: min Spearman "
                  f"{min(g['spearman'] for g in worst):.3f}, max top-1 regret "
                  f"{100 * max(g['top1_regret'] for g in worst):.1f}%")
        big = [g for g in worst if g["layouts"] >= BIG_SWEEP]
        if big:
            print(f"held-out sweeps of >= {BIG_SWEEP} layouts ({len(big)}): min Spearman "
                  f"{min(g['spearman'] for g in big):.3f}, max top-1 regret "
                  f"{100 * max(g['top1_regret'] for g in big):.1f}%")
    s = out["summary"]
    print()
    print(f"rows {s['rows']}  median |error| {100 * s['median_abs_error']:.1f}%  "
          f"mean |error| {100 * s['mean_abs_error']:.1f}%  within 15%: {s['within_15pct']}  "
          f"optimistic {s['optimistic']} / pessimistic {s['pessimistic']} "
          f"(median pred/meas {s['median_ratio']:.3f})")
    print(f"memory false negatives: {len(s['memory_false_negatives'])} "
          f"{' '.join(s['memory_false_negatives'])}")
    mem = s["reported_memory"]
    if mem["rows"]:
        print(f"memory against the {mem['rows']} rows that report it: predicted peak / reported "
              f"median {mem['median_ratio']:.2f}, range {mem['min_ratio']:.2f}-"
              f"{mem['max_ratio']:.2f}, {mem['within_10pct']} within 10%")
    print(f"min Spearman within a source's layouts of one model: {s['min_group_spearman']:.3f}")
    print(f"sweeps: min Spearman {s['min_sweep_spearman']:.3f}, max top-1 regret "
          f"{100 * s['max_sweep_top1_regret']:.1f}%; of >= {BIG_SWEEP} layouts: min Spearman "
          f"{s['min_big_sweep_spearman']:.3f}, max top-1 regret "
          f"{100 * s['max_big_sweep_top1_regret']:.1f}%")
