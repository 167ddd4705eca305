"""Brute-force oracle for the strategy search on small cases (no pruning, exact memory).

Space: every pipeline degree pp in {1, 2} that divides the GPU count, every micro-batch size,
every legal per-layer strategy (space.layer_strategies, rules R1-R5 only: no dominance pruning)
and every vocabulary layout; at pp=1 a stage holds up to two strategies (a block of a then a
block of b, both orders, every split), at pp=2 each stage holds one strategy and every split of
the layers is tried. Each layout is scored with the formula of cost/evaluate.py, vectorised over
all layouts of a (pp, micro-batch, vocabulary) at once; `check_against_evaluate` confirms on
samples that the vectorised score is evaluate's to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_ext.plan import LayerStrategy, PlanLayout, VocabStrategy
from megatron_ext.planner.cost.evaluate import evaluate
from megatron_ext.planner.cost.pipeline import one_f_one_b
from megatron_ext.planner.cost.vocab import stage_extras
from megatron_ext.planner.space import divisors, layer_strategies, vocab_options


@dataclass(frozen=True)
class OracleLayout:
    iteration_s: float
    pp: int
    micro_batch_size: int
    stages: tuple[tuple[int, int], ...]
    layers: tuple[LayerStrategy, ...]
    vocab: VocabStrategy


def _score(cm, ex, m, parts):
    """parts: dict of [..., pp] arrays f, b, sync, gather, opt, mem, work -> (iteration, fits)."""
    exposed = np.maximum(0.0, cm.overlap_slowdown * ex.overlap_comm_s - parts["work"])
    pipe = one_f_one_b(
        parts["f"] + ex.forward_s,
        parts["b"] + ex.backward_s + exposed,
        ex.p2p_s,
        parts["sync"] + ex.grad_sync_s,
        parts["gather"] + ex.param_gather_s,
        parts["opt"] + ex.optimizer_s,
        m,
        overlap_slowdown=cm.overlap_slowdown,
        overlap_grad_reduce=cm.training.overlap_grad_reduce,
        overlap_param_gather=cm.training.overlap_param_gather,
    )
    fits = np.all(parts["mem"] + ex.fixed_bytes <= cm.memory_cap_bytes, axis=-1)
    return np.where(fits, pipe.iteration_s, np.inf)


def _pp1(cm, table, costs, switch, mbs, m, vocab, best):
    L = cm.model.num_layers
    S = len(table)
    k = np.arange(L + 1)[None, None, :]  # layers of a (first block); b gets the rest
    a_ = np.arange(S)[:, None, None]
    b_ = np.arange(S)[None, :, None]
    both = (k > 0) & (k < L)
    for vz in (0, 1):
        used_zero = np.where(k == 0, 0, table.zero[a_] >= 1) | np.where(
            k == L, 0, table.zero[b_] >= 1
        )
        mask_vz = used_zero == bool(vz)
        ex = stage_extras(cm, vocab, 1, mbs, m, vz)
        infl = int(ex.inflight[0])
        sw = np.where(both, switch[a_, b_] / 2, 0.0)

        def mix(x):
            return k * x[a_] + (L - k) * x[b_]

        mem_layer = costs.memory_bytes(infl)
        trans = np.maximum(
            np.where(k > 0, costs.transient_bytes[a_], 0.0),
            np.where(k < L, costs.transient_bytes[b_], 0.0),
        )
        parts = {
            "f": mix(costs.forward_s) + sw,
            "b": mix(costs.backward_s) + sw,
            "sync": mix(costs.grad_sync_s),
            "gather": mix(costs.param_gather_s),
            "opt": mix(costs.optimizer_s),
            "mem": mix(mem_layer) + trans,
            "work": mix(costs.forward_s + costs.backward_s),
        }
        parts = {name: v[..., None] for name, v in parts.items()}  # pp axis
        it = _score(cm, ex, m, parts)
        it = np.where(mask_vz, it, np.inf)
        i = np.unravel_index(int(np.argmin(it)), it.shape)
        if it[i] < best[0].iteration_s:
            a, b, n = (int(x) for x in i)
            layers = (table.strategies[a],) * n + (table.strategies[b],) * (L - n)
            best[0] = OracleLayout(float(it[i]), 1, mbs, ((0, L),), layers, vocab)


def _pp2(cm, table, costs, switch, mbs, m, vocab, best):
    L = cm.model.num_layers
    S = len(table)
    n0 = np.arange(1, L)[None, None, :]
    a_ = np.arange(S)[:, None, None]
    b_ = np.arange(S)[None, :, None]
    counts = [n0, L - n0]
    for vz in (0, 1):
        used_zero = (table.zero[a_] >= 1) | (table.zero[b_] >= 1)
        mask_vz = np.broadcast_to(used_zero == bool(vz), (S, S, L - 1))
        ex = stage_extras(cm, vocab, 2, mbs, m, vz)

        def per_stage(x, k_stage):
            idx = a_ if k_stage == 0 else b_
            return counts[k_stage] * x[idx]

        parts = {}
        for name, arr in (
            ("f", costs.forward_s),
            ("b", costs.backward_s),
            ("sync", costs.grad_sync_s),
            ("gather", costs.param_gather_s),
            ("opt", costs.optimizer_s),
            ("work", costs.forward_s + costs.backward_s),
        ):
            parts[name] = np.stack(
                np.broadcast_arrays(per_stage(arr, 0), per_stage(arr, 1)), axis=-1
            )
        mems = []
        for stage, idx in ((0, a_), (1, b_)):
            per = costs.memory_bytes(int(ex.inflight[stage]))
            mems.append(counts[stage] * per[idx] + costs.transient_bytes[idx])
        parts["mem"] = np.stack(np.broadcast_arrays(*mems), axis=-1)
        it = np.where(mask_vz, _score(cm, ex, m, parts), np.inf)
        i = np.unravel_index(int(np.argmin(it)), it.shape)
        if it[i] < best[0].iteration_s:
            a, b, j = (int(x) for x in i)
            n = j + 1
            layers = (table.strategies[a],) * n + (table.strategies[b],) * (L - n)
            best[0] = OracleLayout(float(it[i]), 2, mbs, ((0, n), (n, L)), layers, vocab)


def oracle(cm) -> OracleLayout | None:
    """The fastest layout of the oracle's space (module docstring); None if nothing fits."""
    model, cluster, t = cm.model, cm.cluster, cm.training
    best = [OracleLayout(math.inf, 0, 0, (), (), VocabStrategy(mode="tp", tp=1))]
    for pp in (1, 2):
        if cluster.num_gpus % pp or pp > model.num_layers:
            continue
        width = cluster.num_gpus // pp
        for mbs in divisors(t.global_batch_size):
            table = layer_strategies(
                model, t, width=width, nvlink_gpus=cluster.nvlink_domain, micro_batch_size=mbs
            )
            if len(table) == 0:
                continue
            costs = cm.layer_costs(table, mbs)
            switch = cm.transition_s(table, mbs)
            m = t.global_batch_size // mbs
            for vocab in vocab_options(
                model,
                width=width,
                pp=pp,
                nvlink_gpus=cluster.nvlink_domain,
                training=t,
                micro_batch_size=mbs,
            ):
                (_pp1 if pp == 1 else _pp2)(cm, table, costs, switch, mbs, m, vocab, best)
    return best[0] if math.isfinite(best[0].iteration_s) else None


def check_against_evaluate(cm, layout: OracleLayout) -> None:
    """The oracle's vectorised score of `layout` is evaluate's."""
    ev = evaluate(
        cm,
        PlanLayout(pp=layout.pp,
        stages=layout.stages,
        layers=layout.layers,
        vocab=layout.vocab,
        micro_batch_size=layout.micro_batch_size),
    )
    assert ev.feasible
    assert math.isclose(ev.iteration_s, layout.iteration_s, rel_tol=1e-9), (
        ev.iteration_s,
        layout.iteration_s,
    )
