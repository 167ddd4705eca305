"""Human-readable output of a search: the stage/layer table, --explain and --plot.

Plain aligned text without ANSI codes (Slurm logs are files).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_ext.errors import PlanError
from megatron_ext.plan import ParallelPlan, VocabStrategy
from megatron_ext.planner.cost.evaluate import Evaluation


def describe_vocab(vocab: VocabStrategy, pp: int) -> str:
    if vocab.mode == "vocab_parallel":
        return (
            f"vocabulary parallel over pp x tp = {pp} x {vocab.tp} ranks "
            f"(embedding, output layer and cross-entropy on every stage)"
        )
    where = "stage 0 / last stage" if pp > 1 else "the only stage"
    return f"tensor-parallel tp={vocab.tp} on {where}"


def _significant(value: float) -> str:
    """3 decimals, or 3 significant digits below 0.1 (a tiny plan never shows 0.000)."""
    return f"{value:.3f}" if value >= 0.1 or value == 0 else f"{value:.3g}"


def format_duration(value_s: float) -> str:
    """`1.234 s` from a second up, `12.3 ms` / `0.0123 ms` below: never `0.000 s`."""
    if value_s >= 1.0 or value_s == 0:
        return f"{value_s:.3f} s"
    ms = value_s * 1e3
    return f"{ms:.1f} ms" if ms >= 1.0 else f"{ms:.3g} ms"


def describe_interval(plan: ParallelPlan, cluster: str | None = None) -> str:
    """'90% interval 1.230 s - 1.450 s' (and the features no published run shares), or ''."""
    from megatron_ext.planner.cost.interval import plan_interval

    pred = plan.prediction
    if pred is None or pred.iteration_time_interval_s is None:
        return ""
    name = cluster if cluster is not None else (plan.cluster.name if plan.cluster else "custom")
    low, high = pred.iteration_time_interval_s
    _, _, unseen = plan_interval(plan, pred.iteration_time_s, name)
    text = f"90% interval {format_duration(low)} - {format_duration(high)}"
    if unseen:
        text += f"; no published run with {', '.join(unseen)}: the widest interval"
    return text


def overlap_note(plan: ParallelPlan, objective: str = "time") -> str:
    """'plans 1-3 are within the model's error; they differ in pp, micro-batch' when the plan's
    runners-up (prediction.runners_up) have overlapping 90% intervals, one line per runner-up."""
    pred = plan.prediction
    if pred is None or not pred.runners_up:
        return ""
    mine: dict[str, str | list[str]] = {
        k: v for k, v in plan_summary(plan).items() if k != "peak GiB"}
    mine["layers"] = sorted({s.describe() for s in plan.layers})
    others = list(pred.runners_up)
    differ = [k for k in mine if any(str(r.get(k)) != str(mine[k]) for r in others)]
    by = "upper end of the 90% interval" if objective == "p90" else "predicted time"
    lines = [
        f"plans 1-{len(others) + 1} (by {by}) are within the model's error (their 90% intervals "
        f"overlap); they differ in {', '.join(differ) or 'nothing listed'}:"
    ]
    for i, r in enumerate([{**mine, "iteration_time_s": pred.iteration_time_s,
                            "iteration_time_interval_s": pred.iteration_time_interval_s},
                           *others]):
        low, high = r["iteration_time_interval_s"]
        lines.append(
            f"  {i + 1}. {format_duration(r['iteration_time_s'])} ({format_duration(low)} - "
            f"{format_duration(high)}): "
            + ", ".join(f"{k} {r[k] if k != 'layers' else ' | '.join(r[k])}" for k in differ)
        )
    return "\n".join(lines) + "\n"


def format_percent(fraction: float) -> str:
    """`47.4%`, or 2 significant digits under 1% (`0.012%`), never `0.0%` for a non-zero value."""
    pct = 100.0 * fraction
    return f"{pct:.1f}%" if pct >= 1.0 or pct == 0 else f"{pct:.2g}%"


def plan_table(plan: ParallelPlan) -> str:
    """Stage / layer-range table with per-stage memory and time, then the prediction."""
    pred = plan.prediction
    # Units follow the plan's size: MiB and ms when every stage stays under 1 GiB / 1 s.
    mib = pred is not None and max(pred.stage_peak_memory_gib) < 1.0
    ms = pred is not None and max(pred.stage_time_s) < 1.0
    rows = [("stage", "layers", "strategy", "mem MiB" if mib else "mem GiB",
             "busy ms" if ms else "busy s")]
    for start, end, strategy in plan.layer_runs():
        chunk = plan.chunk_of_layer(start)
        stage = chunk % plan.pp
        first = start == plan.stages[chunk][0]
        mem = busy = ""
        if pred is not None and first and chunk < plan.pp:  # a stage's figures on its first chunk
            mem = f"{pred.stage_peak_memory_gib[stage] * (1024 if mib else 1):.1f}"
            busy = _significant(pred.stage_time_s[stage] * (1e3 if ms else 1))
        label = str(stage) if plan.virtual_stages == 1 else f"{stage}.{chunk // plan.pp}"
        rows.append(
            (label if first else "", f"[{start}, {end})", strategy.describe(), mem, busy)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [
        "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    m = plan.global_batch_size // plan.micro_batch_size
    if plan.virtual_stages > 1:
        lines.append(f"interleaved 1F1B: {plan.virtual_stages} model chunks per stage "
                     "(stage.chunk above; chunk c of stage k holds stages[c*pp + k])")
    lines.append(f"vocabulary: {describe_vocab(plan.vocab, plan.pp)}")
    lines.append(
        f"batch: micro-batch {plan.micro_batch_size} samples over all replicas x {m} "
        f"micro-batches = {plan.global_batch_size}, seq {plan.seq_length}, {plan.precision}"
    )
    if pred is not None:
        interval = describe_interval(plan)
        lines.append(
            f"predicted: iteration {format_duration(pred.iteration_time_s)}"
            + (f" ({interval})" if interval else "")
            + f", {pred.tokens_per_s:,.0f} tokens/s, MFU {format_percent(pred.mfu)}"
        )
    return "\n".join(lines) + "\n"


def plan_summary(plan: ParallelPlan) -> dict[str, str]:
    recompute = sum(1 for s in plan.layers if s.recompute != "none")
    zeros = sorted({s.zero for s in plan.layers})
    return {
        "pp": str(plan.pp) if plan.virtual_stages == 1 else f"{plan.pp}x{plan.virtual_stages}v",
        "stage sizes": ",".join(str(e - s) for s, e in plan.stages),
        "micro-batch": str(plan.micro_batch_size),
        "strategies": str(len(set(plan.layers))),
        "recomputed layers": f"{recompute}/{len(plan.layers)}",
        "zero levels": ",".join(map(str, zeros)),
        "vocabulary": f"{plan.vocab.mode} tp={plan.vocab.tp}",
        "peak GiB": f"{max(plan.prediction.stage_peak_memory_gib):.1f}" if plan.prediction else "-",
    }


def explain(
    plan: ParallelPlan, ev: Evaluation, uniform: ParallelPlan | None, uniform_ev: Evaluation | None
) -> str:
    """The best uniform (Megatron-LM) layout beside the plan, and where the time goes in each."""
    if uniform is None or uniform_ev is None:
        return (
            "explain: no uniform Megatron-LM layout fits this memory; only the layerwise one does\n"
        )
    lines = ["explain: best uniform Megatron-LM layout vs the chosen plan"]
    a, b = plan_summary(uniform), plan_summary(plan)
    rows = [("", "uniform", "plan")] + [(k, a[k], b[k]) for k in a]
    keys = sorted(set(uniform_ev.breakdown) | set(ev.breakdown))
    rows += [
        (
            k.removesuffix("_s").replace("_", " ") + " s",
            f"{uniform_ev.breakdown.get(k, 0):.3f}",
            f"{ev.breakdown.get(k, 0):.3f}",
        )
        for k in keys
    ]
    rows.append(("iteration s", f"{uniform_ev.iteration_s:.3f}", f"{ev.iteration_s:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines += [
        "  "
        + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.append(
        f"  uniform layers: {uniform.layers[0].describe()}; vocabulary "
        f"{describe_vocab(uniform.vocab, uniform.pp)}"
    )
    lines += ["  why: " + reason for reason in _reasons(uniform_ev, ev)]
    return "\n".join(lines) + "\n"


def _reasons(uniform_ev: Evaluation, ev: Evaluation) -> list[str]:
    """The breakdown terms that changed most between the two (seconds per iteration, on each
    layout's busiest stage)."""
    deltas = sorted(
        ((uniform_ev.breakdown.get(k, 0) - ev.breakdown.get(k, 0), k) for k in ev.breakdown),
        reverse=True,
    )
    speedup = uniform_ev.iteration_s / ev.iteration_s
    out = [
        (
            f"predicted speedup {speedup:.3f}x "
            f"({uniform_ev.iteration_s:.3f} s -> {ev.iteration_s:.3f} s)"
        )
    ]
    for delta, key in deltas:
        if abs(delta) >= 0.005 * uniform_ev.iteration_s:
            verb = "saves" if delta > 0 else "costs"
            out.append(
                f"{key.removesuffix('_s').replace('_', ' ')}: the plan {verb} {abs(delta):.3f} s"
            )
    if speedup <= 1.0 + 1e-9:
        out.append("the layerwise search found nothing faster: the uniform layout is the plan")
    return out


def check_plot_support() -> None:
    """Raise the one-line --plot error now when matplotlib is missing (before any work)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlanError(
            "--plot needs matplotlib; install it with pip install 'megatron_ext[plot]' "
            "or drop --plot"
        ) from None


@dataclass(frozen=True, kw_only=True, slots=True)
class PlotLayout:
    """What the --plot picture shows, kept apart from matplotlib so it can be tested."""

    title: str
    """Model, GPUs, pipeline stages and the predicted iteration."""
    legend: tuple[tuple[str, str], ...]
    """(matplotlib colour, strategy) for every strategy the plan uses, in layer order."""
    layer_colors: tuple[str, ...]
    """Colour of each layer's bar."""
    memory_unit: str
    """GiB, or MiB when every stage peaks under 1 GiB (tiny plans: bars stay readable)."""
    stage_memory: tuple[float, ...]
    """Predicted peak memory per stage, in memory_unit."""
    memory_limit: float | None
    """Memory per GPU in memory_unit, None when the plan carries no cluster."""
    memory_limit_label: str
    """Legend text of the memory-per-GPU line."""
    memory_ylim: float
    """Top of the memory axis: the limit when the bars are at least a quarter of it, else
    just above the tallest bar (the limit is then off scale and its label says so)."""
    time_unit: str
    """s, or ms when every stage is busy under a second."""
    stage_time: tuple[float, ...]
    """Predicted busy time per stage per iteration, in time_unit."""


def plot_layout(plan: ParallelPlan) -> PlotLayout:
    names = list(dict.fromkeys(s.describe() for s in plan.layers))
    colors = {n: f"C{i % 10}" for i, n in enumerate(names)}
    pred = plan.prediction
    peaks_gib = tuple(pred.stage_peak_memory_gib) if pred else ()
    times_s = tuple(pred.stage_time_s) if pred else ()
    mib = bool(peaks_gib) and max(peaks_gib) < 1.0
    scale, unit = (1024.0, "MiB") if mib else (1.0, "GiB")
    memory = tuple(v * scale for v in peaks_gib)
    cluster = plan.cluster
    limit = cluster.memory_gib * scale if cluster is not None else None
    top = max(memory, default=0.0) * 1.15 or 1.0
    label = ""
    if cluster is not None and limit is not None:
        on_scale = max(memory, default=0.0) >= 0.25 * limit
        top = max(top, limit * 1.05) if on_scale else top
        label = f"memory per GPU {cluster.memory_gib:g} GiB" + (
            "" if on_scale else " (off scale)")
    ms = bool(times_s) and max(times_s) < 1.0
    title = f"{plan.model.name} on {plan.world_size} GPUs, pp={plan.pp}"
    if pred is not None:
        title += f", predicted iteration {format_duration(pred.iteration_time_s)}"
    return PlotLayout(
        title=title,
        legend=tuple((colors[n], n) for n in names),
        layer_colors=tuple(colors[s.describe()] for s in plan.layers),
        memory_unit=unit,
        stage_memory=memory,
        memory_limit=limit,
        memory_limit_label=label,
        memory_ylim=top,
        time_unit="ms" if ms else "s",
        stage_time=tuple(t * (1e3 if ms else 1.0) for t in times_s),
    )


def plot_plan(plan: ParallelPlan, path: str | Path) -> None:
    """Per-layer strategies (with a legend) and per-stage memory/time bars (needs matplotlib)."""
    check_plot_support()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    layout = plot_layout(plan)
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), constrained_layout=True)
    fig.suptitle(layout.title)
    axes[0].bar(range(len(plan.layers)), [1] * len(plan.layers), color=layout.layer_colors,
                width=1.0)
    for start, _ in plan.stages[1:]:
        axes[0].axvline(start - 0.5, color="black")
    handles = [Patch(color=c, label=n) for c, n in layout.legend]
    handles.append(Line2D([], [], color="black", label="stage boundary"))
    axes[0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    axes[0].set_title("strategy per layer", fontsize=10)
    axes[0].set_yticks([])
    axes[0].set_xlabel("layer")
    if layout.stage_memory:
        bars = axes[1].bar(range(plan.pp), layout.stage_memory, label="predicted peak")
        axes[1].bar_label(bars, fmt="%.3g", fontsize=8)
        if layout.memory_limit is not None:
            if layout.memory_limit <= layout.memory_ylim:
                axes[1].axhline(layout.memory_limit, color="red", linestyle="--",
                                label=layout.memory_limit_label)
            else:
                axes[1].plot([], [], color="red", linestyle="--", label=layout.memory_limit_label)
        axes[1].set_ylim(0, layout.memory_ylim)
        axes[1].set_ylabel(f"peak {layout.memory_unit}")
        axes[1].set_title("predicted peak memory per stage", fontsize=10)
        axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        bars = axes[2].bar(range(plan.pp), layout.stage_time)
        axes[2].bar_label(bars, fmt="%.3g", fontsize=8)
        axes[2].margins(y=0.15)
        axes[2].set_ylabel(f"busy {layout.time_unit} / iteration")
        axes[2].set_title("predicted busy time per stage", fontsize=10)
        axes[2].set_xlabel("pipeline stage")
        for ax in axes[1:]:
            ax.set_xticks(range(plan.pp))
    fig.savefig(path)
    plt.close(fig)
