"""When nothing fits: the least memory per GPU, and the fewest GPUs, that would.

State floor (any model, any GPU count): every parameter's copies over the d ranks that share it
hold at least its bytes at d = 1 (each ZeRO level's bytes per GPU are kept + sharded / d,
memory.py), so the cluster holds at least P x min over ZeRO levels of those bytes (mixed
precision with Adam: ZeRO-3's fp32 weight 4 + fp32 gradient 4 + two states 8 = 16 B), and needs
at least that over the usable memory per GPU (cap = memory - reserve) of GPUs.

Minimum memory at a given GPU count (exact for the cost model up to the DP's quantisation): for
every pp, micro-batch size and vocabulary layout, each layer of stage k takes the strategy with the
least memory there (states + inflight_k * activations, plus its transient), so stage k with n
layers needs c_k + n a_k. The smallest max_k (c_k + n_k a_k) with sum n_k = L is found by
bisection on the bound M (stage k then holds at most (M - c_k) / a_k layers). MoE models price
every layer at its cheapest kind (a dense layer's state where the model has any), so there the
state floor over the GPUs is the tighter bound; the larger of the two is used.

Fewest nodes: from the first node count that both bounds allow, the search itself is run at
each count in turn (a few tries: a count whose GPUs divide the model or the batch badly may
not fit where the next one does); the hint names the first count where it finds a layout, or
says the floor and how far the search looked.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from megatron_ext.planner.cost.compute import model_parameters
from megatron_ext.planner.cost.memory import state_bytes_per_param
from megatron_ext.planner.cost.model import CostModel, LayerCosts
from megatron_ext.planner.cost.moe import kind_costs, layer_kinds, valid_for
from megatron_ext.planner.cost.vocab import stage_extras
from megatron_ext.planner.space import StrategyTable, divisors, layer_strategies, vocab_options
from megatron_ext.specs import ClusterSpec

GIB = 2**30
MAX_GPUS = 65536
"""The largest GPU count the hints consider."""


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
                model,
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
    need = max(min_allocated_bytes(cm), state_floor_bytes(cm) / cm.cluster.num_gpus) / GIB
    if not math.isfinite(need):
        return math.inf
    if cm.training.reserve_gib is not None:
        return need + cm.training.reserve_gib
    return (need + 1.0) / 0.96  # memory - (1 + 0.04 memory) >= need


def state_floor_bytes(cm: CostModel) -> float:
    """Least weight, gradient and optimizer-state bytes the whole cluster holds for the model
    (module docstring: the state floor)."""
    t = cm.training
    per_param = min(
        float(state_bytes_per_param(zero, 1, half_precision=t.half_precision,
                                    num_optimizer_states=t.num_optimizer_states))
        for zero in range(4)
    )
    return model_parameters(cm.model) * per_param


def state_floor_gpus(cm: CostModel) -> int:
    """Fewest GPUs of this cluster's memory whose usable bytes hold the state floor (more than
    MAX_GPUS where the reserve leaves no usable bytes)."""
    if cm.memory_cap_bytes <= 0:
        return MAX_GPUS + 1
    return max(1, math.ceil(state_floor_bytes(cm) / cm.memory_cap_bytes))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NodeHint:
    """What the node search found."""

    floor: int
    """Fewest nodes both lower bounds allow (above the cluster's own count)."""
    fits: int | None
    """Fewest nodes from `floor` on at which the search found a layout; None if none of the
    counts tried did."""
    tried_up_to: int
    """The largest node count tried (`floor - 1` if none was: beyond max_gpus)."""


def min_nodes(cm: CostModel, fits: Callable[[ClusterSpec], bool], *, tries: int = 8,
              max_gpus: int = MAX_GPUS) -> NodeHint:
    """Fewest nodes (same GPUs) at which the search finds a layout. `fits(cluster)` runs it.

    The floor is the larger of the state floor and the memory bound's count (doubling, then
    bisection on min_memory_gib); from there `tries` counts are searched in turn (a count the
    memory bound rules out is skipped without a search)."""
    c = cm.cluster
    gpn = c.gpus_per_node

    def at(nodes: int) -> CostModel:
        return cm.with_cluster(dataclasses.replace(c, num_nodes=nodes))

    def bound_fits(nodes: int) -> bool:
        return min_memory_gib(at(nodes)) <= c.memory_gib

    floor = max(c.num_nodes + 1, math.ceil(state_floor_gpus(cm) / gpn))
    if floor * gpn > max_gpus:
        return NodeHint(floor=floor, fits=None, tried_up_to=floor - 1)
    if not bound_fits(floor):
        lo, hi = floor, floor * 2
        while not bound_fits(hi):
            lo, hi = hi, hi * 2
            if hi * gpn > max_gpus:
                return NodeHint(floor=hi, fits=None, tried_up_to=hi - 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if bound_fits(mid) else (mid, hi)
        floor = hi
    nodes = floor
    for nodes in range(floor, floor + tries):
        if nodes * gpn > max_gpus:
            return NodeHint(floor=floor, fits=None, tried_up_to=nodes - 1)
        if bound_fits(nodes) and fits(dataclasses.replace(c, num_nodes=nodes)):
            return NodeHint(floor=floor, fits=nodes, tried_up_to=nodes)
    return NodeHint(floor=floor, fits=None, tried_up_to=nodes)


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


def explain_infeasible(cm: CostModel, fits: Callable[[ClusterSpec], bool]) -> str:
    """One line: what does not fit and the smallest memory or GPU count that would.

    `fits(cluster)` says whether the search finds a layout on that cluster (this one with more
    memory per GPU, or with more nodes)."""
    c = cm.cluster
    memory = verified_min_memory_gib(
        cm, lambda gib: fits(dataclasses.replace(c, memory_gib=gib)))
    nodes = min_nodes(cm, fits)
    head = (
        f"no layout of {cm.model.name} fits {c.num_gpus} GPUs x {c.memory_gib:g} GiB "
        f"(global batch {cm.training.global_batch_size}, seq {cm.training.seq_length})"
    )
    gpn = c.gpus_per_node
    needs = []
    if math.isfinite(memory):
        needs.append(f"at least {math.ceil(memory * 10) / 10:g} GiB per GPU (--memory-gib)")
    if nodes.fits is not None:
        needs.append(f"{nodes.fits * gpn} GPUs (--nodes {nodes.fits})")
        return f"{head}; it needs {' or '.join(needs)}"
    states = state_floor_gpus(cm)
    if cm.memory_cap_bytes <= 0:
        more = (f"{c.memory_gib:g} GiB per GPU leaves nothing after the "
                f"{cm.training.reserve_bytes(c.memory_gib) / GIB:g} GiB reserve")
    elif states > MAX_GPUS:
        more = (f"its weights, gradients and optimizer states alone need {states} GPUs of "
                f"{c.memory_gib:g} GiB, more than {MAX_GPUS}")
    elif nodes.tried_up_to < nodes.floor:
        more = f"no GPU count up to {MAX_GPUS} fits either; lower --seq-length or the batch"
    else:
        more = (f"at {c.memory_gib:g} GiB it needs at least {nodes.floor * gpn} GPUs "
                f"(--nodes {nodes.floor}), and the search found no layout up to "
                f"{nodes.tried_up_to * gpn} GPUs (--nodes {nodes.tried_up_to}): try more nodes, "
                "a shorter --seq-length or a smaller batch")
    return f"{head}; " + (f"it needs {needs[0]}; " if needs else "") + more
