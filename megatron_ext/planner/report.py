"""Human-readable output of a search: the stage/layer table, --explain and --plot.

Plain aligned text without ANSI codes (Slurm logs are files).
"""

from __future__ import annotations

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


def plan_table(plan: ParallelPlan) -> str:
    """Stage / layer-range table with per-stage memory and time, then the prediction."""
    pred = plan.prediction
    rows = [("stage", "layers", "strategy", "mem GiB", "busy s")]
    for start, end, strategy in plan.layer_runs():
        stage = plan.stage_of_layer(start)
        first = start == plan.stages[stage][0]
        mem = f"{pred.stage_peak_memory_gib[stage]:.1f}" if pred and first else ""
        busy = f"{pred.stage_time_s[stage]:.3f}" if pred and first else ""
        rows.append(
            (str(stage) if first else "", f"[{start}, {end})", strategy.describe(), mem, busy)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [
        "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    m = plan.global_batch_size // plan.micro_batch_size
    lines.append(f"vocabulary: {describe_vocab(plan.vocab, plan.pp)}")
    lines.append(
        f"batch: micro-batch {plan.micro_batch_size} samples over all replicas x {m} "
        f"micro-batches = {plan.global_batch_size}, seq {plan.seq_length}, {plan.precision}"
    )
    if pred is not None:
        lines.append(
            f"predicted: iteration {pred.iteration_time_s:.3f} s, "
            f"{pred.tokens_per_s:,.0f} tokens/s, MFU {100 * pred.mfu:.1f}%"
        )
    return "\n".join(lines) + "\n"


def _summary(plan: ParallelPlan) -> dict[str, str]:
    recompute = sum(1 for s in plan.layers if s.recompute != "none")
    zeros = sorted({s.zero for s in plan.layers})
    return {
        "pp": str(plan.pp),
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
    a, b = _summary(uniform), _summary(plan)
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


def plot_plan(plan: ParallelPlan, path: str | Path) -> None:
    """Per-layer strategies and per-stage memory/time bars (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlanError(
            "--plot needs matplotlib; install it with pip install 'megatron_ext[plot]'"
        ) from None
    names = list(dict.fromkeys(s.describe() for s in plan.layers))
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), constrained_layout=True)
    axes[0].bar(
        range(len(plan.layers)),
        [1] * len(plan.layers),
        color=[f"C{names.index(s.describe()) % 10}" for s in plan.layers],
        width=1.0,
    )
    for start, _ in plan.stages[1:]:
        axes[0].axvline(start - 0.5, color="black")
    axes[0].set_title(
        "strategy per layer: " + "; ".join(f"C{i % 10}={n}" for i, n in enumerate(names)),
        fontsize=8,
    )
    axes[0].set_yticks([])
    axes[0].set_xlabel("layer (black lines: stage boundaries)")
    pred = plan.prediction
    if pred is not None:
        axes[1].bar(range(plan.pp), pred.stage_peak_memory_gib)
        if plan.cluster is not None:
            axes[1].axhline(plan.cluster.memory_gib, color="red", linestyle="--")
        axes[1].set_ylabel("peak GiB")
        axes[2].bar(range(plan.pp), pred.stage_time_s)
        axes[2].set_ylabel("busy s / iteration")
        axes[2].set_xlabel("pipeline stage")
        for ax in axes[1:]:
            ax.set_xticks(range(plan.pp))
    fig.savefig(path)
    plt.close(fig)
