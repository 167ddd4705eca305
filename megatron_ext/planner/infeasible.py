"""When nothing fits: the least memory per GPU, and the fewest GPUs, that would.

Minimum memory at a given GPU count (exact for the cost model up to the DP's quantisation): for
every pp, micro-batch size and vocabulary layout, each layer of stage k takes the strategy with the
least memory there (states + inflight_k * activations, plus its transient), so stage k with n
layers needs c_k + n a_k. The smallest max_k (c_k + n_k a_k) with sum n_k = L is found by
bisection on the bound M (stage k then holds at most (M - c_k) / a_k layers).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from megatron_ext.planner.cost.model import CostModel, LayerCosts
from megatron_ext.planner.cost.moe import kind_costs, layer_kinds, valid_for
from megatron_ext.planner.cost.vocab import stage_extras
from megatron_ext.planner.space import StrategyTable, divisors, layer_strategies, vocab_options

GIB = 2**30


def _stage_capacity(
    bound: float, fixed: np.ndarray, transient: np.ndarray, per_layer: np.ndarray
) -> np.ndarray:  # [pp]
    """Most layers each stage holds within `bound` bytes. The transient peak is that of the worst
    strategy used, so try every threshold T (transient [S], sorted ascending) with the cheapest
    per-layer memory among strategies whose transient is <= T (per_layer [pp, S], prefix-min)."""
    room = bound - fixed[:, None] - transient[None, :]  # [pp, S]
    return np.max(np.where(room >= 0, np.floor(room / per_layer), -1), axis=1)


def _min_max_bytes(
    fixed: np.ndarray, transient: np.ndarray, per_layer: np.ndarray, num_layers: int
) -> float:
    """Smallest bound M (to 1e-4 relative) at which the stages hold num_layers layers, >= 1 each."""
    lo = 0.0
    hi = float(np.max(fixed) + transient[-1] + num_layers * np.max(per_layer[:, -1]))
    while hi - lo > 1e-4 * hi:
        mid = (lo + hi) / 2
        caps = _stage_capacity(mid, fixed, transient, per_layer)
        if caps.min() >= 1 and caps.sum() >= num_layers:
            hi = mid
        else:
            lo = mid
    return hi


def min_allocated_bytes(cm: CostModel) -> float:
    """Least peak allocated memory per GPU (reserve excluded) of any layout on this cluster."""
    model, cluster, t = cm.model, cm.cluster, cm.training
    best = math.inf
    for pp in [p for p in divisors(cluster.num_gpus) if p <= model.num_layers]:
        width = cluster.num_gpus // pp
        for mbs in divisors(t.global_batch_size):
            table = layer_strategies(
                model, t, width=width, nvlink_gpus=cluster.nvlink_domain, micro_batch_size=mbs
            )
            if len(table) == 0:
                continue
            costs = _least_memory_costs(cm, table, mbs)
            order = np.argsort(costs.transient_bytes)
            transient = costs.transient_bytes[order]
            m = t.global_batch_size // mbs
            options = vocab_options(
                width=width,
                pp=pp,
                nvlink_gpus=cluster.nvlink_domain,
                training=t,
                micro_batch_size=mbs,
            )
            for vocab in options:
                ex = stage_extras(cm, vocab, pp, mbs, m, vocab_zero=1)
                per_layer = np.stack(
                    [np.minimum.accumulate(costs.memory_bytes(int(i))[order]) for i in ex.inflight]
                )
                bound = _min_max_bytes(ex.fixed_bytes, transient, per_layer, model.num_layers)
                best = min(best, bound)
    return best


def _least_memory_costs(cm: CostModel, table: StrategyTable, mbs: int) -> LayerCosts:
    """The layer costs whose memory bounds every layer's from below: a dense model's own; for
    MoE models each strategy's smallest state, activation and transient bytes over the layer
    kinds the model has that may use it (inf where none may: the strategy is never chosen)."""
    per_kind = kind_costs(cm, table, mbs)
    if len(per_kind) == 1:
        return per_kind[0]
    # the kinds the model has (Mixtral: MoE only)
    used = np.unique(layer_kinds(cm.model, cm.training.fp8))
    valid = valid_for(cm.model, table)
    least = {
        name: np.min(np.stack([np.where(valid[k], getattr(per_kind[k], name), np.inf)
                               for k in used]), axis=0)
        for name in ("state_bytes", "activation_bytes", "transient_bytes")
    }
    return dataclasses.replace(per_kind[int(used[-1])], **least)


def min_memory_gib(cm: CostModel) -> float:
    """Smallest --memory-gib at which some layout fits (the reserve grows with memory)."""
    need = min_allocated_bytes(cm) / GIB
    if not math.isfinite(need):
        return math.inf
    if cm.training.reserve_gib is not None:
        return need + cm.training.reserve_gib
    return (need + 1.0) / 0.96  # memory - (1 + 0.04 memory) >= need


def min_nodes(cm: CostModel, max_gpus: int = 65536) -> int | None:
    """Fewest nodes (same GPUs) at which some layout fits; doubling, then bisection."""

    def fits(nodes: int) -> bool:
        other = cm.with_cluster(dataclasses.replace(cm.cluster, num_nodes=nodes))
        return min_memory_gib(other) <= cm.cluster.memory_gib

    lo, hi = cm.cluster.num_nodes, cm.cluster.num_nodes * 2
    while not fits(hi):
        lo, hi = hi, hi * 2
        if hi * cm.cluster.gpus_per_node > max_gpus:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def verified_min_memory_gib(cm: CostModel, fits: Callable[[float], bool]) -> float:
    """min_memory_gib, raised in 2% steps until `fits(memory_gib)` (the search itself, whose DP
    rounds memory up) really finds a layout there; inf if three steps do not suffice."""
    memory = math.ceil(min_memory_gib(cm) * 10) / 10
    for _ in range(4):
        if not math.isfinite(memory):
            break
        if fits(memory):
            return memory
        memory = math.ceil(memory * 1.02 * 10) / 10
    return math.inf


def explain_infeasible(cm: CostModel, fits: Callable[[float], bool]) -> str:
    """One line: what does not fit and the smallest memory or GPU count that would.

    `fits(memory_gib)` says whether the search finds a layout with that much memory per GPU."""
    c = cm.cluster
    memory = verified_min_memory_gib(cm, fits)
    nodes = min_nodes(cm)
    parts = [
        (
            f"no layout of {cm.model.name} fits {c.num_gpus} GPUs x {c.memory_gib:g} GiB "
            f"(global batch {cm.training.global_batch_size}, seq {cm.training.seq_length})"
        )
    ]
    if math.isfinite(memory):
        parts.append(
            f"it needs at least {math.ceil(memory * 10) / 10:g} GiB per GPU (--memory-gib)"
        )
    if nodes is not None:
        parts.append(f"or {nodes * c.gpus_per_node} GPUs (--nodes {nodes})")
    if len(parts) == 1:
        parts.append("no GPU count up to 65536 fits either; lower --seq-length or the batch")
    return "; ".join(parts[:2]) + (" " + parts[2] if len(parts) > 2 else "")
