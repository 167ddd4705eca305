"""Exhaustive search over what stock Megatron-LM can express, on the same cost model.

Space: one strategy for every layer (tp, sp, cp, dp, recompute none/selective/full, distributed
optimizer on/off), pp, micro-batch size, vocabulary layers tensor-parallel with the layers' tp,
and Megatron's uneven pipeline split (--decoder-first/last-pipeline-num-layers: any first and
last stage size, the middle stages even), or Megatron's interleaved schedule
(--num-layers-per-virtual-pipeline-stage: v equal chunks per rank, which Megatron-LM allows with
even stages only, and a micro-batch count that is a multiple of pp). Every combination is scored
with the same (interleaved) 1F1B formula as `evaluate`, vectorised over [strategies,
partitions, stages].
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from megatron_ext.plan import PlanLayout, VocabStrategy
from megatron_ext.planner.cost.evaluate import Evaluation, evaluate
from megatron_ext.planner.cost.model import CostModel, LayerCosts
from megatron_ext.planner.cost.moe import is_moe_kind, kind_costs, layer_kinds, valid_for
from megatron_ext.planner.cost.pipeline import (
    interleaved_peak_units,
    one_f_one_b,
    pipeline_lower_bound_s,
)
from megatron_ext.planner.cost.vocab import StageExtras, stage_extras
from megatron_ext.planner.space import StrategyTable, divisors, layer_strategies

MAX_VIRTUAL_STAGES = 8
"""Most chunks per rank the search tries (each one more point-to-point message per micro-batch
and rank; the bubble gain beyond 8 is below 1/(8 m) of the iteration)."""


def virtual_stage_options(cm: CostModel, pp: int, micro_batch_size: int, *,
                          even_only: bool) -> list[int]:
    """Chunks per rank v > 1 the interleaved schedule may use at (pp, micro-batch size): pp > 1,
    the micro-batch count a multiple of pp (megatron-core's interleaved schedule), at least one
    layer per chunk; even_only (Megatron-LM's --num-layers-per-virtual-pipeline-stage): every
    chunk the same size. Empty when the search may not interleave."""
    layers = cm.model.num_layers
    m = cm.training.global_batch_size // micro_batch_size
    if not cm.training.allow_interleaving or pp == 1 or m < pp or m % pp:
        return []
    return [v for v in range(2, min(layers // pp, MAX_VIRTUAL_STAGES) + 1)
            if not even_only or layers % (pp * v) == 0]


def megatron_partitions(num_layers: int, pp: int) -> np.ndarray:  # [P, pp] layer counts
    """Every split Megatron's first/last-stage flags give: a first, b last, (L-a-b)/(pp-2) else."""
    if pp == 1:
        return np.array([[num_layers]])
    rows = []
    for a in range(1, num_layers):
        for b in range(1, num_layers - a + 1):
            middle = num_layers - a - b
            if pp == 2:
                if middle == 0:
                    rows.append([a, b])
            elif middle >= pp - 2 and middle % (pp - 2) == 0:
                rows.append([a] + [middle // (pp - 2)] * (pp - 2) + [b])
    return np.array(rows, dtype=np.int64).reshape(-1, pp)


@functools.lru_cache(maxsize=64)
def _partitions(num_layers: int, pp: int) -> np.ndarray:
    return megatron_partitions(num_layers, pp).astype(float)


def score_uniform(
    cm: CostModel, pp: int, micro_batch_size: int, bound_s: float = np.inf, *, fsdp: bool = False,
) -> tuple[float, PlanLayout] | None:
    """Best uniform layout at this (pp, micro-batch size) faster than bound_s, or None.
    fsdp=True also tries ZeRO-3 everywhere (FSDP2), which Megatron-LM allows with pp=1 and
    untied embeddings only. Every allowed chunk count (`virtual_stage_options`, even chunks) is
    scored too: v > 1 is the interleaved schedule with v equal chunks per rank. MoE models: one
    strategy for every layer, its expert degrees (--expert-model-parallel-size,
    --expert-tensor-parallel-size) on the MoE layers only, each stage priced by its own count
    of dense and MoE layers."""
    found = score_uniform_each(cm, pp, micro_batch_size, bound_s, fsdp=fsdp, prune=True)
    return min(found, key=lambda f: f[0]) if found else None


def score_uniform_each(
    cm: CostModel, pp: int, micro_batch_size: int, bound_s: float = np.inf, *, fsdp: bool = False,
    prune: bool = False,
) -> list[tuple[float, PlanLayout]]:
    """`score_uniform`'s best layout for each chunk count v that has one faster than bound_s
    (prune: only those faster than every v scored before them)."""
    model, cluster = cm.model, cm.cluster
    width = cluster.num_gpus // pp
    table = layer_strategies(
        model,
        cm.training,
        width=width,
        nvlink_gpus=cluster.nvlink_domain,
        micro_batch_size=micro_batch_size,
        uniform=True,
        uniform_fsdp=fsdp and pp == 1 and not model.tied_embeddings,
    )
    if len(table) == 0:
        return []
    per_kind = kind_costs(cm, table, micro_batch_size)
    out: list[tuple[float, PlanLayout]] = []
    for v in [1, *virtual_stage_options(cm, pp, micro_batch_size, even_only=True)]:
        bound = min([bound_s, *(f[0] for f in out)]) if prune else bound_s
        found = _score_uniform_v(cm, table, per_kind, pp, micro_batch_size, bound, v)
        if found is not None:
            out.append(found)
    return out


def _score_uniform_v(cm: CostModel, table: StrategyTable, per_kind: list[LayerCosts], pp: int,
                     micro_batch_size: int, bound_s: float,
                     v: int) -> tuple[float, PlanLayout] | None:
    model = cm.model
    usable = valid_for(model, table)[-1]  # the MoE layers' rules (dense models: all)
    kinds = layer_kinds(model, cm.training.fp8)
    m = cm.training.global_batch_size // micro_batch_size
    if v == 1:
        parts = _partitions(model.num_layers, pp)  # [P, pp]
    else:
        parts = np.full((1, pp), model.num_layers / pp)
    counts = _kind_counts(kinds, parts, len(per_kind), pp, v)  # [K, P, pp]
    totals = [float(np.sum(kinds == k)) for k in range(len(per_kind))]
    best: tuple[float, PlanLayout] | None = None
    for key in sorted({(int(tp), min(int(z), 1)) for tp, z in zip(table.tp, table.zero)}):
        ex = stage_extras(cm, VocabStrategy(mode="tp", tp=key[0]), pp, micro_batch_size, m, key[1],
                          virtual_stages=v)
        work = sum(n * (c.forward_s + c.backward_s) for n, c in zip(totals, per_kind))
        work = work + (ex.forward_s + ex.backward_s).sum()
        bound = min(bound_s, best[0] if best else np.inf)
        sel = np.flatnonzero(
            (table.tp == key[0])
            & (np.minimum(table.zero, 1) == key[1])
            & usable
            & (pipeline_lower_bound_s(work, pp, m) * interleave_bound(pp, m, v) < bound)
        )
        if len(sel) == 0:
            continue
        found = _best_of(cm, per_kind, sel, ex, counts, m, v)
        if found is not None and (best is None or found[0] < best[0]):
            i, sizes = found[1], parts[found[2]].astype(int)
            if v > 1:
                sizes = np.full(pp * v, model.num_layers // (pp * v))
            bounds = np.concatenate([[0], np.cumsum(sizes)])
            chosen = table.strategies[i]
            dense = dataclasses.replace(chosen, ep=1, etp=None)
            best = (
                found[0],
                PlanLayout(
                    pp=pp,
                    micro_batch_size=micro_batch_size,
                    stages=tuple((int(bounds[k]), int(bounds[k + 1]))
                                 for k in range(len(sizes))),
                    layers=tuple(chosen if is_moe_kind(kind) else dense
                                 for kind in kinds.tolist()),
                    vocab=VocabStrategy(mode="tp", tp=key[0]),
                    virtual_stages=v,
                ),
            )
    return best


def interleave_bound(pp: int, m: int, v: int) -> float:
    """How far below the 1F1B lower bound (m + pp - 1) W / pp an interleaved schedule may go:
    (m + (pp - 1) / v) / (m + pp - 1)."""
    return (m + (pp - 1) / v) / (m + pp - 1)


def _kind_counts(kinds: np.ndarray, parts: np.ndarray, num_kinds: int, pp: int,
                 v: int = 1) -> np.ndarray:
    """[K, P, pp]: layers of each kind on each rank of each partition (v > 1: parts is the even
    split and rank k holds chunks k, pp + k, ... of L / (pp v) layers)."""
    if num_kinds == 1:
        return parts[None]
    out = []
    for kind in range(num_kinds):
        prefix = np.concatenate([[0], np.cumsum(kinds == kind)])
        if v == 1:
            ends = np.cumsum(parts, axis=1).astype(np.int64)
            starts = ends - parts.astype(np.int64)
            out.append((prefix[ends] - prefix[starts]).astype(float))
        else:
            size = len(kinds) // (pp * v)
            out.append(np.array([[sum(prefix[(c * pp + k + 1) * size]
                                      - prefix[(c * pp + k) * size] for c in range(v))
                                  for k in range(pp)]], dtype=float))
    return np.stack(out)


def _best_of(
    cm: CostModel, per_kind: list[LayerCosts], sel: np.ndarray, ex: StageExtras,
    counts: np.ndarray, m: int, v: int = 1
) -> tuple[float, int, int] | None:
    """(iteration, strategy index, partition index) of the fastest feasible pair in sel x parts;
    `per_kind` the LayerCosts of each layer kind, `counts` [K, P, pp] layers of each kind per
    stage; v > 1: the interleaved schedule with v equal chunks per rank (the even split)."""
    col = lambda a: a[sel][:, None, None]
    if v == 1:
        inflight = ex.inflight
    else:  # in-flight chunk micro-batches at the peak, in units of a whole rank's layers
        inflight = interleaved_peak_units(len(ex.inflight), m, v) / v
    mem = ex.fixed_bytes
    transient: float | np.ndarray = 0.0
    for n, costs in zip(counts, per_kind):
        mem = mem + n[None] * (col(costs.state_bytes) + inflight * col(costs.activation_bytes))
        if len(per_kind) == 1:
            transient = col(costs.transient_bytes)
        else:  # the largest transient of the kinds the stage holds
            transient = np.maximum(transient, np.where(n[None] > 0, col(costs.transient_bytes),
                                                       0.0))
    mem = mem + transient
    fits = np.all(mem <= cm.memory_cap_bytes, axis=-1)  # [S, P]
    si, pj = np.nonzero(fits)
    if len(si) == 0:
        return None
    c = lambda a: a[sel][si][:, None]

    def stage(name: str) -> np.ndarray:
        total: float | np.ndarray = 0.0
        for n, costs in zip(counts, per_kind):
            total = total + n[pj] * c(getattr(costs, name))
        return np.asarray(total)

    pipe = one_f_one_b(
        stage("forward_s") + ex.forward_s,
        stage("backward_s") + ex.backward_s,
        ex.p2p_s,
        stage("grad_sync_s") + ex.grad_sync_s,
        stage("param_gather_s") + ex.param_gather_s,
        stage("optimizer_s") + ex.optimizer_s,
        m,
        overlap_slowdown=cm.overlap_slowdown,
        virtual_stages=v,
        overlap_grad_reduce=cm.training.overlap_grad_reduce,
        overlap_param_gather=cm.training.overlap_param_gather,
    )
    k = int(np.argmin(pipe.iteration_s))
    return float(pipe.iteration_s[k]), int(sel[si[k]]), int(pj[k])


def search_uniform(
    cm: CostModel, *, progress: Callable[[str], None] | None = None, fsdp: bool = False
) -> tuple[PlanLayout, Evaluation] | None:
    """The fastest uniform layout over every pp and micro-batch size; None if nothing fits.
    fsdp=True widens the baseline with Megatron-LM's FSDP2 (ZeRO-3 everywhere, pp=1)."""
    model, cluster = cm.model, cm.cluster
    best: tuple[float, PlanLayout] | None = None
    for pp in [p for p in divisors(cluster.num_gpus) if p <= model.num_layers]:
        for mbs in divisors(cm.training.global_batch_size):
            found = score_uniform(cm, pp, mbs, best[0] if best else np.inf, fsdp=fsdp)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
        if progress is not None:
            progress(f"uniform: pp={pp} done" + (f", best {best[0]:.3f} s" if best else ""))
    if best is None:
        return None
    layout = best[1]
    ev = evaluate(cm, layout)
    assert abs(ev.iteration_s - best[0]) <= 1e-9 * best[0], (ev.iteration_s, best[0])
    return layout, ev
