"""Strategy search: space x cost model -> layerwise DP -> pipeline partition -> ParallelPlan.

Outer loops: pipeline degree pp (divisors of the GPU count, <= layers) x micro-batch size B
(divisors of the global batch). Each (pp, B) "combo" is scored in this order:
  1. lower bound (bounds.py: a memory-aware LP relaxation of the layer choice, the output GEMM,
     and 1F1B's (m + pp - 1) / pp); combos are visited by increasing bound and the rest are
     skipped once the bound reaches the best exact iteration time found (the uniform baseline
     seeds it), which cannot discard the optimum;
  2. candidate strategies (space.py, rules R1-R5) and dominance pruning (R6);
  3. one layerwise DP per transient level and distinct in-flight count, at the largest memory
     budget any vocabulary layout leaves; it answers every layer count and every smaller budget
     at once. A stage's peak is its states and activations plus the largest transient memory
     (recomputed activations, ZeRO-3's gathered weights) of the strategies it uses, so each
     level T runs over the strategies with transient <= T within cap - fixed - T, and a stage
     takes the best level;
  4. for every vocabulary layout (tensor-parallel on first/last stage, or vocabulary parallel):
     per-stage budgets, slot times, and the exact partition (partition.py);
  5. the best few are backtracked to per-layer strategies, repaired against exact memory (the
     DP rounds each layer up to whole units: a change of one layer to a faster strategy that
     fits unrounded is taken) and scored exactly (cost/evaluate.py).
  6. each scored layout is also tried on Megatron's interleaved schedule (virtual_stages v =
     2..8 chunks per rank, chunks cut at near-equal time; `interleaved_variants`) and scored
     exactly; the combo bound is scaled by the interleaved schedule's smaller bubble so
     pruning stays safe. The uniform baseline includes interleaving (uniform.py).
The result is the fastest exactly-scored layout, layerwise or uniform (a uniform layout is a
point of the layerwise space, so the search never returns anything slower than the baseline).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import numpy as np

from megatron_ext.errors import InfeasiblePlanError, PlanError
from megatron_ext.plan import LayerStrategy, ParallelPlan, PlanLayout, Prediction, VocabStrategy
from megatron_ext.plan_checks import check_sequence
from megatron_ext.planner.bounds import combo_bound, combo_bound_kinds
from megatron_ext.planner.cost.evaluate import Evaluation, evaluate
from megatron_ext.planner.cost.interval import overlap_relax, search_relax, with_interval
from megatron_ext.planner.cost.model import CostModel, LayerCosts
from megatron_ext.planner.cost.moe import kind_costs, layer_kinds, per_layer_costs, valid_for
from megatron_ext.planner.cost.pipeline import gradient_tail_s
from megatron_ext.planner.cost.vocab import StageExtras, stage_extras
from megatron_ext.planner.dp import MaxSwitch, StageDP, layer_dp, switch_groups
from megatron_ext.planner.infeasible import explain_infeasible
from megatron_ext.planner.partition import best_partition, bmw_partition
from megatron_ext.planner.report import plan_summary
from megatron_ext.planner.space import (
    StrategyTable,
    divisors,
    layer_strategies,
    prune_components,
    vocab_options,
)
from megatron_ext.planner.training import TrainingSpec
from megatron_ext.planner.uniform import (
    interleave_bound,
    score_uniform_each,
    search_uniform,
    virtual_stage_options,
)
from megatron_ext.specs import ClusterSpec, FP8Spec, ModelSpec

Progress = Callable[[str], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchOptions:
    """Knobs of the search (defaults are what `megatron-ext search` uses)."""

    uniform_only: bool = False
    """Search only what Megatron-LM expresses (--uniform)."""
    memory_units: int = 4096
    """DP memory quantisation: the memory cap is cut into this many units and each layer's
    memory rounded up to whole units (so a DP solution always fits); a stage of n layers then
    loses at most n / memory_units of the cap, which the exact repair pass recovers."""
    partition: Literal["exact", "bmw"] = "exact"
    """Pipeline partitioner: exact min-makespan, or Galvatron-BMW's heuristic walk."""
    finalists: int = 1
    """Vocabulary layouts per combo backtracked and scored exactly."""
    finalist_slack: float = 0.02
    """Score exactly only layouts whose DP estimate is within this fraction of the best."""
    explain_infeasible: bool = True
    """When nothing fits, work out the smallest memory and GPU count that would (slower)."""
    objective: Literal["time", "p90"] = "time"
    """time: the fastest predicted iteration; p90: the lowest upper end of the 90% prediction
    interval (planner/cost/interval.py) among the candidates the search scored exactly (each
    visited combo's finalists, the uniform baseline, the layerwise result)."""
    runners_up: int = 3
    """Candidates whose interval overlaps the chosen plan's, kept in its prediction."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    """The chosen plan with its prediction, and the best uniform plan beside it."""

    plan: ParallelPlan
    """The fastest layout found, with prediction and cluster set."""
    evaluation: Evaluation
    """Its exact score."""
    uniform_plan: ParallelPlan | None
    """The fastest layout stock Megatron-LM can express, if any fits."""
    uniform_evaluation: Evaluation | None
    """Its score."""
    search_s: float
    """Wall-clock seconds the search took."""
    stats: dict[str, int] = field(default_factory=dict)
    """Combos visited / pruned, DP runs, exact evaluations."""
    candidates: tuple[ParallelPlan, ...] = ()
    """The exactly scored layouts, best first by the objective (the plan is the first)."""


@dataclass(slots=True)
class _Combo:
    pp: int
    micro_batch_size: int
    table: StrategyTable
    costs: list[LayerCosts]
    """Per layer kind the model has (dense models: one)."""
    valid: np.ndarray
    """[K, S]: which strategies each kind may use."""
    bound_s: float


def search(
    cm: CostModel, *, options: SearchOptions = SearchOptions(), progress: Progress | None = None
) -> SearchResult:
    """Find the fastest layout that fits; raises InfeasiblePlanError if none does, PlanError
    (before any work) if the inputs break a rule every plan must keep."""
    check_sequence(
        cm.training.seq_length, cm.model.max_position_embeddings, seq_name="--seq-length"
    )
    if cm.training.tp_comm_overlap:
        raise PlanError("the search does not plan --tp-comm-overlap (megatron_ext's training "
                        "runtime refuses it); search without it and price it with evaluate "
                        "--tp-comm-overlap")
    start = time.perf_counter()
    stats = {"combos": 0, "combos_pruned": 0, "dp_runs": 0, "exact_evaluations": 0}
    uniform = search_uniform(cm, progress=progress)
    best: tuple[PlanLayout, Evaluation] | None = uniform
    seen: list[tuple[PlanLayout, Evaluation]] = [uniform] if uniform else []
    if not options.uniform_only:
        found = _layerwise(
            cm, options, uniform[1].iteration_s if uniform else math.inf, stats, progress, seen
        )
        if found is not None and (best is None or found[1].iteration_s < best[1].iteration_s):
            best = found
    if best is None:
        if not options.explain_infeasible:
            raise InfeasiblePlanError(f"no layout of {cm.model.name} fits")
        raise InfeasiblePlanError(explain_infeasible(cm, partial(_fits_on, cm)))
    _near_candidates(cm, options, best, stats, seen)
    ranked = _rank_candidates(cm, best, seen, options)
    plan, evaluation = ranked[0]
    uniform_plan = layout_to_plan(cm, uniform[0], uniform[1]) if uniform else None
    return SearchResult(
        plan=plan,
        evaluation=evaluation,
        uniform_plan=uniform_plan,
        uniform_evaluation=uniform[1] if uniform else None,
        search_s=time.perf_counter() - start,
        stats=stats,
        candidates=tuple(p for p, _ in ranked),
    )


def _near_candidates(
    cm: CostModel,
    options: SearchOptions,
    best: tuple[PlanLayout, Evaluation],
    stats: dict[str, int],
    seen: list[tuple[PlanLayout, Evaluation]],
) -> None:
    """Add to `seen` the best uniform layout per (pp, micro-batch) whose interval could overlap
    the fastest layout's (predicted faster than its upper end x overlap_relax: the overlap note
    compares them) and, with --objective p90, the layerwise layouts that could have a lower
    upper end (predicted faster than its upper end / search_relax; exact, since scale,
    precision and cluster are fixed within a search)."""
    plan = layout_to_plan(cm, best[0], best[1])
    relax = search_relax(num_gpus=cm.cluster.num_gpus, precision=cm.training.precision,
                         cluster=cm.cluster.name)
    bound = _upper(plan) / relax
    near = max(bound, _upper(plan) * overlap_relax())
    for pp in [p for p in divisors(cm.cluster.num_gpus) if p <= cm.model.num_layers]:
        for mbs in divisors(cm.training.global_batch_size):
            for _, layout in score_uniform_each(cm, pp, mbs, near):  # one per chunk count
                seen.append((layout, evaluate(cm, layout)))
    if options.objective == "p90" and not options.uniform_only:
        _layerwise(cm, options, bound, stats, None, seen)


def _predicted(plan: ParallelPlan) -> Prediction:
    """The prediction a plan the search made carries (layout_to_plan always sets one)."""
    assert plan.prediction is not None
    return plan.prediction


def _upper(plan: ParallelPlan) -> float:
    interval = _predicted(plan).iteration_time_interval_s
    return interval[1] if interval else _predicted(plan).iteration_time_s


def _rank_candidates(
    cm: CostModel,
    best: tuple[PlanLayout, Evaluation],
    seen: list[tuple[PlanLayout, Evaluation]],
    options: SearchOptions,
) -> list[tuple[ParallelPlan, Evaluation]]:
    """The exactly scored layouts as plans with intervals, best first by the objective (ties:
    the faster point prediction); the chosen plan's prediction lists the runners-up whose
    interval overlaps its own."""
    unique: dict[tuple, tuple[PlanLayout, Evaluation]] = {}
    for layout, ev in [best, *seen]:
        if ev.feasible:
            key = (layout.pp, layout.virtual_stages, layout.stages, layout.layers,
                   layout.micro_batch_size, layout.vocab)
            unique.setdefault(key, (layout, ev))
    plans = [(layout_to_plan(cm, layout, ev), ev) for layout, ev in unique.values()]
    if options.objective == "p90":
        plans.sort(key=lambda pe: (_upper(pe[0]), pe[1].iteration_s))
    else:
        plans.sort(key=lambda pe: pe[1].iteration_s)
    chosen = plans[0][0]
    low = _predicted(chosen).iteration_time_interval_s
    overlapping = [
        p for p, _ in plans[1:] if _overlap(low, _predicted(p).iteration_time_interval_s)
    ][: options.runners_up]
    if overlapping:
        chosen = dataclasses.replace(chosen, prediction=dataclasses.replace(
            _predicted(chosen), runners_up=tuple(runner_up(p) for p in overlapping)))
    return [(chosen, plans[0][1]), *plans[1:]]


def _overlap(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool:
    """Whether two 90% intervals (None: unknown) overlap."""
    return a is not None and b is not None and b[0] <= a[1] and a[0] <= b[1]


def runner_up(plan: ParallelPlan) -> dict[str, object]:
    """A runner-up as the plan file's prediction keeps it: its layout in brief and its
    prediction."""
    pred = _predicted(plan)
    return {
        **{k: v for k, v in plan_summary(plan).items() if k != "peak GiB"},
        "layers": sorted({s.describe() for s in plan.layers}),
        "iteration_time_s": round(pred.iteration_time_s, 6),
        "iteration_time_interval_s": list(pred.iteration_time_interval_s or ()),
    }


def _fits_on(cm: CostModel, cluster: ClusterSpec) -> bool:
    """Whether the search finds a layout on `cluster` (more memory per GPU, or more nodes)."""
    try:
        search(cm.with_cluster(cluster), options=SearchOptions(explain_infeasible=False))
    except InfeasiblePlanError:
        return False
    return True


def layout_to_plan(cm: CostModel, layout: PlanLayout, evaluation: Evaluation) -> ParallelPlan:
    t = cm.training
    return with_interval(ParallelPlan(
        world_size=cm.cluster.num_gpus,
        pp=layout.pp,
        stages=layout.stages,
        virtual_stages=layout.virtual_stages,
        layers=layout.layers,
        model=cm.model,
        micro_batch_size=layout.micro_batch_size,
        global_batch_size=t.global_batch_size,
        seq_length=t.seq_length,
        vocab=layout.vocab,
        precision=t.precision,
        fp8=t.fp8,
        overlap_grad_reduce=t.overlap_grad_reduce,
        # Megatron-LM overlaps the weight all-gather of a distributed optimizer only
        overlap_param_gather=t.overlap_param_gather and any(s.zero == 1 for s in layout.layers),
        cluster=cm.cluster,
        prediction=evaluation.prediction(),
    ))


def _layerwise(
    cm: CostModel,
    options: SearchOptions,
    best_s: float,
    stats: dict[str, int],
    progress: Progress | None,
    seen: list[tuple[PlanLayout, Evaluation]] | None = None,
) -> tuple[PlanLayout, Evaluation] | None:
    combos = sorted(_combos(cm), key=lambda c: c.bound_s)
    stats["combos"] = len(combos)
    best: tuple[PlanLayout, Evaluation] | None = None
    for i, combo in enumerate(combos):
        if combo.bound_s >= best_s:
            stats["combos_pruned"] = len(combos) - i
            break
        for found in _solve_combo(cm, combo, options, best_s, stats):
            for layout in [found, *interleaved_variants(cm, found)]:
                ev = evaluate(cm, layout)
                stats["exact_evaluations"] += 1
                if seen is not None and ev.feasible:
                    seen.append((layout, ev))
                if ev.feasible and ev.iteration_s < best_s:
                    best, best_s = (layout, ev), ev.iteration_s
        if progress is not None:
            progress(
                f"layerwise: pp={combo.pp} micro-batch={combo.micro_batch_size} "
                f"({i + 1}/{len(combos)}), best {best_s:.3f} s"
            )
    return best


def interleaved_variants(cm: CostModel, layout: PlanLayout) -> list[PlanLayout]:
    """The layout's per-layer strategies on the interleaved schedule: for every allowed v, the
    layers cut into pp * v contiguous chunks of near-equal forward + backward time (chunk j
    ends where the running time first reaches (j + 1) / (pp v) of the total, at least one layer
    each), so each rank's v chunks carry about the same work. The caller scores them exactly;
    memory decides whether one fits (interleaving keeps more micro-batches in flight)."""
    if layout.virtual_stages != 1 or layout.vocab.mode != "tp":
        return []
    pp, n = layout.pp, len(layout.layers)
    options = virtual_stage_options(cm, pp, layout.micro_batch_size, even_only=False)
    if not options:
        return []
    distinct = list(dict.fromkeys(layout.layers))
    index = np.array([distinct.index(s) for s in layout.layers], dtype=np.int64)
    costs = per_layer_costs(cm, StrategyTable.of(distinct), layout.micro_batch_size, index)
    work = costs.forward_s + costs.backward_s  # one row per layer, priced as its kind
    total = np.concatenate([[0.0], np.cumsum(work)])
    out = []
    for v in options:
        chunks = pp * v
        ends, start = [], 0
        for j in range(chunks - 1):
            target = total[-1] * (j + 1) / chunks
            end = int(np.searchsorted(total, target, side="left"))
            # round to the nearer boundary, keep one layer for every chunk on either side
            if end > 0 and target - total[end - 1] < total[min(end, n)] - target:
                end -= 1
            end = min(max(end, start + 1), n - (chunks - 1 - j))
            ends.append(end)
            start = end
        bounds = [0, *ends, n]
        out.append(dataclasses.replace(
            layout, virtual_stages=v,
            stages=tuple((bounds[j], bounds[j + 1]) for j in range(chunks))))
    return out


@dataclass(frozen=True, slots=True)
class _Kinds:
    """Layer kinds of the model as the search sees them: `kinds` [L] indexes the kinds the model
    uses (0..K-1; a dense model, or one whose layers are all MoE, has K = 1); `used` maps them
    back to cost/moe.py's DENSE / MOE. Stages starting at different layers see different kind
    sequences: `of_start[a]` is the class of start a, `seqs[c]` the kind sequence class c's
    DP runs over (a start's first n kinds are a prefix of its class's sequence)."""

    kinds: np.ndarray
    used: np.ndarray
    of_start: tuple[int, ...]
    seqs: tuple[np.ndarray, ...]

    @property
    def single(self) -> bool:
        return len(self.seqs) == 1

    @classmethod
    def of(cls, model: ModelSpec, n_hi: int | None = None,
           fp8: FP8Spec | None = None) -> _Kinds:
        all_kinds = layer_kinds(model, fp8)
        used = np.unique(all_kinds)
        kinds = np.searchsorted(used, all_kinds)
        num = len(kinds)
        n_hi = num if n_hi is None else max(1, min(n_hi, num))
        if len(used) == 1:
            return cls(kinds=kinds, used=used, of_start=(0,) * num, seqs=(kinds[:n_hi],))
        keys = [tuple(kinds[a:min(num, a + n_hi)].tolist()) for a in range(num)]
        seqs: list[tuple[int, ...]] = []
        of_start = [0] * num
        for a in sorted(range(num), key=lambda a: -len(keys[a])):
            for c, key in enumerate(seqs):
                if key[: len(keys[a])] == keys[a]:
                    of_start[a] = c
                    break
            else:
                seqs.append(keys[a])
                of_start[a] = len(seqs) - 1
        return cls(kinds=kinds, used=used, of_start=tuple(of_start),
                   seqs=tuple(np.array(q, dtype=np.int64) for q in seqs))


def _combos(cm: CostModel) -> list[_Combo]:
    model, cluster, t = cm.model, cm.cluster, cm.training
    used = _Kinds.of(model, fp8=t.fp8).used
    out = []
    for pp in [p for p in divisors(cluster.num_gpus) if p <= model.num_layers]:
        for mbs in divisors(t.global_batch_size):
            table = layer_strategies(
                model,
                t,
                width=cluster.num_gpus // pp,
                nvlink_gpus=cluster.nvlink_domain,
                micro_batch_size=mbs,
            )
            if len(table) == 0:
                continue
            per_kind = kind_costs(cm, table, mbs)
            costs = [per_kind[u] for u in used]
            valid = valid_for(model, table)[used]
            if len(costs) == 1:
                bound = combo_bound(cm, costs[0], pp, mbs, valid=valid[0])
            else:
                counts = [int(np.sum(layer_kinds(model, t.fp8) == u)) for u in used]
                bound = combo_bound_kinds(cm, costs, valid, counts, pp, mbs)
            virtual = virtual_stage_options(cm, pp, mbs, even_only=False)
            if virtual:  # an interleaved variant of the combo's layouts may go below 1F1B's
                bound *= interleave_bound(pp, t.global_batch_size // mbs, max(virtual))
            if math.isfinite(bound):
                out.append(
                    _Combo(pp=pp, micro_batch_size=mbs, table=table, costs=costs, valid=valid,
                           bound_s=bound)
                )
    return out


def _take(costs: LayerCosts, index: np.ndarray) -> LayerCosts:
    return LayerCosts(**{name: getattr(costs, name)[index] for name in LayerCosts.__slots__})


@dataclass(slots=True)
class _Level:
    """Strategies whose transient memory is at most `transient_bytes` (one transient level):
    a stage using only these needs transient_bytes on top of its states and activations.
    Per layer kind: `ok` [K, S_j] says which kind may use which strategy at this level."""

    transient_bytes: float
    index: np.ndarray  # [S_j] into the kept table
    table: StrategyTable
    costs: list[LayerCosts]
    objective: np.ndarray  # [K, S_j], inf where not ok
    ok: np.ndarray  # [K, S_j]
    max_switch: MaxSwitch
    budgets: list[np.ndarray]  # per vocabulary layout, [pp] units
    dps: dict[tuple[int, int], StageDP]  # (kind class, in-flight count)

    def dp_inputs(self, inflight: int, unit: float) -> tuple[np.ndarray, np.ndarray]:
        """(cost, memory units) for layer_dp: [S_j] with one kind, [K, S_j] with several."""
        mem = np.stack([
            np.ceil(np.where(ok, c.memory_bytes(inflight), 0.0) / unit).astype(np.int64)
            for c, ok in zip(self.costs, self.ok)
        ])
        if len(self.costs) == 1:
            return self.objective[0], mem[0]
        return self.objective, mem


def _levels(
    cm: CostModel,
    table: StrategyTable,
    costs: list[LayerCosts],
    objective: np.ndarray,
    valid: np.ndarray,
    mbs: int,
    extras: list[StageExtras],
    unit: float,
) -> list[_Level]:
    """One level per distinct transient memory of the kept strategies. The stage's peak is its
    states and activations plus the largest transient of the strategies it uses, so the exact
    feasible set is the union over levels T of "strategies with transient <= T within
    cap - fixed - T" (subtracting the largest transient of all strategies from every budget
    would charge ZeRO-3's gathered weights to stages that use no ZeRO-3). With several layer
    kinds a strategy's transient is its kind's."""
    trans = np.stack([np.where(ok, c.transient_bytes, np.inf) for c, ok in zip(costs, valid)])
    values = np.unique(trans[np.isfinite(trans)])
    if cm.model.moe is not None:
        # MoE models (R9, heuristic): levels rounded up to 1/64 of the memory cap. Expert
        # layouts multiply the distinct transients; a stage then loses at most cap/64 of its
        # budget, which the exact repair pass (_ExactStage) gives back layer by layer.
        step = cm.memory_cap_bytes / 64
        values = np.unique(np.ceil(values / step) * step)
    out = []
    for level in values:
        ok = trans <= level
        index = np.flatnonzero(ok.any(axis=0))
        sub = table.subset(index)
        out.append(
            _Level(
                transient_bytes=float(level),
                index=index,
                table=sub,
                costs=[_take(c, index) for c in costs],
                objective=np.where(ok[:, index], objective[:, index], np.inf),
                ok=ok[:, index],
                max_switch=cm.transition_model(sub, mbs),
                budgets=[
                    np.floor((cm.memory_cap_bytes - ex.fixed_bytes - level) / unit).astype(
                        np.int64
                    )
                    for ex in extras
                ],
                dps={},
            )
        )
    return out


def _solve_combo(
    cm: CostModel, combo: _Combo, options: SearchOptions, best_s: float, stats: dict[str, int]
) -> list[PlanLayout]:
    """Steps 2-5 of the module docstring for one (pp, micro-batch size)."""
    model, t = cm.model, cm.training
    pp, mbs = combo.pp, combo.micro_batch_size
    m = t.global_batch_size // mbs
    switch_all = cm.transition_s(combo.table, mbs)
    valid_all = combo.valid
    objective_all = np.stack([
        np.where(ok, c.objective_s(m, cm.overlap_slowdown, cm.training), np.inf)
        for c, ok in zip(combo.costs, valid_all)
    ])  # [K, S]
    comps = np.concatenate([
        np.stack([obj, np.where(ok, c.state_bytes, np.inf),
                  np.where(ok, c.activation_bytes, np.inf),
                  np.where(ok, c.transient_bytes, np.inf)], axis=1)
        for c, ok, obj in zip(combo.costs, valid_all, objective_all)
    ], axis=1)
    keep = prune_components(comps, switch_all, combo.table.layout)
    table = combo.table.subset(keep)
    costs = [_take(c, keep) for c in combo.costs]
    valid, objective = valid_all[:, keep], objective_all[:, keep]
    vocabs = vocab_options(
        model,
        width=cm.cluster.num_gpus // pp,
        pp=pp,
        nvlink_gpus=cm.cluster.nvlink_domain,
        # the layerwise runtime does not run MoE models with vocabulary parallelism
        training=t if model.moe is None else dataclasses.replace(t, allow_vocab_parallel=False),
        micro_batch_size=mbs,
    )
    extras = [stage_extras(cm, v, pp, mbs, m, vocab_zero=1) for v in vocabs]
    n_hi = model.num_layers - pp + 1
    if math.isfinite(best_s):  # a stage of n layers alone takes m * n * fastest per iteration
        fastest = min(float(np.min(np.where(ok, c.forward_s + c.backward_s, np.inf)))
                      for c, ok in zip(costs, valid))
        n_hi = min(n_hi, int(best_s / (m * fastest)))
    if n_hi < 1:
        return []
    kinds = _Kinds.of(model, n_hi, cm.training.fp8)
    unit = cm.memory_cap_bytes / options.memory_units
    levels = _levels(cm, table, costs, objective, valid, mbs, extras, unit)
    needed = {kinds.of_start[0]} if pp == 1 else set(range(len(kinds.seqs)))
    for level in levels:
        level.dps = _stage_dps(level, extras, unit, kinds, needed)
        stats["dp_runs"] += len(level.dps)
    partition = best_partition if options.partition == "exact" else bmw_partition
    scored = []
    for v, (vocab, ex) in enumerate(zip(vocabs, extras)):
        slot, which = _slots(ex, v, levels, n_hi, m, cm.overlap_slowdown, kinds, cm.training)
        found = partition(slot, model.num_layers, m)
        if found is not None:
            scored.append((found[0], vocab, v, which, found[1]))
    scored.sort(key=lambda item: item[0])
    exact = _ExactStage(cm, table, costs, objective, valid, mbs, m, kinds.kinds)
    out = []
    virtual = virtual_stage_options(cm, pp, mbs, even_only=False)
    # its interleaved variants (scored by the caller) may be faster than the 1F1B estimate
    factor = interleave_bound(pp, m, max(virtual)) if virtual else 1.0
    for estimate, vocab, v, which, counts in scored[: options.finalists]:
        if estimate * factor > best_s * (1 + options.finalist_slack):
            break
        picks = _backtrack(levels, unit, extras[v], v, which, counts, kinds)
        out.append(exact.layout(picks, vocab, extras[v]))
    return out


def _stage_dps(
    level: _Level, extras: list[StageExtras], unit: float, kinds: _Kinds, needed: set[int]
) -> dict[tuple[int, int], StageDP]:
    """One layerwise DP per kind class and distinct in-flight count, at the largest budget any
    stage with that count has under any vocabulary layout; smaller budgets are read from the
    same table."""
    ms = level.max_switch
    switch = ms.matrix()[np.ix_(level.table.layout, level.table.layout)]
    tops: dict[int, int] = {}
    for ex, budget in zip(extras, level.budgets):
        for inflight, units in zip(ex.inflight.tolist(), budget.tolist()):
            tops[inflight] = max(tops.get(inflight, -1), units)
    dps = {}
    groups = switch_groups(switch, level.table.layout, ms)
    for inflight, top in sorted(tops.items()):
        if top < 0:
            continue
        cost, mem_units = level.dp_inputs(inflight, unit)
        for c, seq in enumerate(kinds.seqs):
            if c not in needed:  # no stage starts where this kind sequence does
                continue
            dps[(c, inflight)] = layer_dp(
                cost,
                mem_units,
                switch,
                num_layers=len(seq),
                budget_units=top,
                layout=level.table.layout,
                max_switch=ms,
                groups=groups,
                kinds=seq if cost.ndim == 2 else None,
            )
    return dps


def _slots(
    ex: StageExtras,
    v: int,
    levels: list[_Level],
    n_hi: int,
    m: int,
    slowdown: float,
    kinds: _Kinds,
    training: TrainingSpec,
) -> tuple[np.ndarray, np.ndarray]:
    """Slot time of stage k with n layers: DP time (best over transient levels) + vocabulary
    work + p2p + exposed side-stream communication + the vocabulary tail spread over the
    micro-batches. [pp, n_hi + 1] seconds and the level that gives them; with several kind
    classes [pp, L + 1, n_hi + 1], the middle axis the stage's first layer."""
    pp = len(ex.inflight)
    per_class = []
    for c in range(len(kinds.seqs)):
        layers = np.full((pp, n_hi + 1), np.inf)
        which = np.zeros((pp, n_hi + 1), dtype=np.int64)
        for j, level in enumerate(levels):
            budget = level.budgets[v]
            for k in range(pp):
                dp = level.dps.get((c, int(ex.inflight[k])))
                if dp is None or budget[k] < 0:
                    continue
                here = np.full(n_hi + 1, np.inf)
                rows = min(n_hi + 1, dp.best.shape[0])
                here[:rows] = dp.best[:rows, budget[k]]
                better = here < layers[k]
                layers[k] = np.where(better, here, layers[k])
                which[k] = np.where(better, j, which[k])
        per_class.append((layers, which))
    if kinds.single:
        layers, which = per_class[0]
    else:
        num = len(kinds.kinds)
        layers = np.full((pp, num + 1, n_hi + 1), np.inf)
        which = np.zeros((pp, num + 1, n_hi + 1), dtype=np.int64)
        for a, c in enumerate(kinds.of_start):
            top = min(n_hi, num - a) + 1
            layers[:, a, :top] = per_class[c][0][:, :top]
            which[:, a, :top] = per_class[c][1][:, :top]
    slot = np.full(layers.shape, np.inf)
    for k in range(pp):
        tail = float(gradient_tail_s(
            ex.forward_s[k], ex.backward_s[k], ex.grad_sync_s[k], ex.param_gather_s[k],
            ex.optimizer_s[k], slowdown, overlap_grad_reduce=training.overlap_grad_reduce,
            overlap_param_gather=training.overlap_param_gather))
        hidden = np.maximum(0.0, slowdown * ex.overlap_comm_s[k] - layers[k])
        slot[k] = (
            layers[k] + ex.forward_s[k] + ex.backward_s[k] + 2 * ex.p2p_s[k] + hidden + tail / m
        )
    return slot, which


def _backtrack(
    levels: list[_Level],
    unit: float,
    ex: StageExtras,
    v: int,
    which: np.ndarray,
    counts: list[int],
    kinds: _Kinds,
) -> list[list[int]]:
    """Per-layer strategies (indices into the kept table) of a partition: rerun each stage's
    DP at its level keeping its choices."""
    out = []
    cache: dict[tuple[int, int, int, int, int], list[int]] = {}
    start = 0
    for k, n in enumerate(counts):
        j = int(which[k, n] if which.ndim == 2 else which[k, start, n])
        c = kinds.of_start[start]
        level = levels[j]
        key = (j, c, int(ex.inflight[k]), int(n), int(level.budgets[v][k]))
        if key not in cache:
            ms = level.max_switch
            cost, mem_units = level.dp_inputs(key[2], unit)
            dp = layer_dp(
                cost,
                mem_units,
                ms.matrix()[np.ix_(level.table.layout, level.table.layout)],
                num_layers=key[3],
                budget_units=key[4],
                layout=level.table.layout,
                max_switch=ms,
                keep_choices=True,
                kinds=kinds.seqs[c] if cost.ndim == 2 else None,
            )
            cache[key] = [int(level.index[i]) for i in dp.picks(key[3], key[4])]
        out.append(cache[key])
        start += n
    return out


class _ExactStage:
    """Exact (unquantised) memory of a stage and a repair pass over it.

    The DP rounds each layer's memory up to whole units, so a stage it fills may still have
    room for a faster strategy on a layer or two. The repair changes one layer at a time to
    the strategy that lowers the DP objective (layer time + switch costs) the most while the
    stage's exact memory (fixed + states + in-flight activations + largest transient) fits,
    until no change helps. Each layer is priced as its kind (dense or MoE).

    The DP's per-layer objective spreads a layer's gradient tail (exposed reduction, optimizer)
    over the m micro-batches, which is its weight on the bottleneck stage. The first stage
    finishes the iteration last (cost/pipeline.py one_f_one_b: nothing runs after its backward),
    so there the tail is exposed in full: a second repair of that stage weighs it once, and
    `evaluate` keeps the fastest of the candidates."""

    def __init__(
        self,
        cm: CostModel,
        table: StrategyTable,
        costs: list[LayerCosts],
        objective: np.ndarray,  # [K, S]
        valid: np.ndarray,  # [K, S]
        mbs: int,
        m: int,
        kinds: np.ndarray,  # [L]
    ) -> None:
        self.cm, self.table, self.costs, self.objective = cm, table, costs, objective
        self.valid, self.kinds = valid, kinds
        self.mbs, self.m = mbs, m
        self.switch = cm.transition_s(table, mbs)
        self.objective_full_tail = np.stack([  # [K, S]: the tail weighed once (m = 1)
            np.where(ok, c.objective_s(1, cm.overlap_slowdown, cm.training), np.inf)
            for c, ok in zip(costs, valid)])

    def repair(self, picks: list[int], fixed: float, inflight: int,
               kinds: np.ndarray, objective: np.ndarray | None = None) -> list[int]:
        picks = list(picks)
        mem = np.stack([np.where(ok, c.memory_bytes(inflight), 0.0)
                        for c, ok in zip(self.costs, self.valid)])  # [K, S]
        trans = np.stack([np.where(ok, c.transient_bytes, 0.0)
                          for c, ok in zip(self.costs, self.valid)])
        cap = self.cm.memory_cap_bytes - fixed
        obj, sw = self.objective if objective is None else objective, self.switch
        n = len(picks)
        for _ in range(4 * n * obj.shape[1]):
            arr = np.array(picks)
            base = float(mem[kinds, arr].sum())
            cur_t = trans[kinds, arr]
            best_gain, best_move = 1e-12 * float(obj[kinds, arr].sum()), None
            for i, s in enumerate(picks):
                c = kinds[i]
                rest_t = np.delete(cur_t, i).max(initial=0.0)
                fits = base - mem[c, s] + mem[c] + np.maximum(rest_t, trans[c]) <= cap
                gain = obj[c, s] - obj[c]
                if i > 0:
                    gain += sw[picks[i - 1], s] - sw[picks[i - 1]]
                if i + 1 < n:
                    gain += sw[s, picks[i + 1]] - sw[:, picks[i + 1]]
                gain = np.where(fits & np.isfinite(obj[c]), gain, -np.inf)
                j = int(np.argmax(gain))
                if gain[j] > best_gain:
                    best_gain, best_move = float(gain[j]), (i, j)
            if best_move is None:
                break
            picks[best_move[0]] = best_move[1]
        return picks

    def layout(self, picks: list[list[int]], vocab: VocabStrategy, ex: StageExtras) -> PlanLayout:
        """The backtracked layout, repaired stage by stage, and with the first stage repaired
        again under its full tail (the fastest of the distinct candidates, exactly)."""
        repaired, start = [], 0
        for k, p in enumerate(picks):
            stage_kinds = self.kinds[start:start + len(p)]
            repaired.append(self.repair(p, float(ex.fixed_bytes[k]), int(ex.inflight[k]),
                                        stage_kinds))
            start += len(p)
        first_stage = self.repair(repaired[0], float(ex.fixed_bytes[0]), int(ex.inflight[0]),
                                  self.kinds[:len(picks[0])], self.objective_full_tail)
        candidates = [picks]
        for option in (repaired, [first_stage, *repaired[1:]]):
            if option not in candidates:
                candidates.append(option)
        if len(candidates) == 1:
            return self._to_layout(picks, vocab)
        scored = [(evaluate(self.cm, layout), layout)
                  for layout in (self._to_layout(c, vocab) for c in candidates)]
        feasible = [(ev.iteration_s, i) for i, (ev, _) in enumerate(scored) if ev.feasible]
        return scored[min(feasible)[1] if feasible else 0][1]

    def _to_layout(self, picks: list[list[int]], vocab: VocabStrategy) -> PlanLayout:
        layers: list[LayerStrategy] = []
        stages: list[tuple[int, int]] = []
        for p in picks:
            stages.append((len(layers), len(layers) + len(p)))
            layers += [self.table.strategies[i] for i in p]
        return PlanLayout(
            pp=len(picks),
            micro_batch_size=self.mbs,
            stages=tuple(stages),
            layers=tuple(layers),
            vocab=vocab,
        )
