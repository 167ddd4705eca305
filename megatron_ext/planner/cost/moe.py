"""Cost of Mixture-of-Experts layers: what an MoE layer adds to, and removes from, a dense one.

Megatron-Core's MoE layer (alltoall token dispatcher, the one Megatron-LM's MoE recipes use)
under a layer strategy with expert degrees ep = e and etp = t (per rank, one micro-batch; legend
of cost/model.py, plus E routed experts, top-k, f the expert width, f_s the shared experts' width,
u = 2 for swiglu else 1, rho the load-imbalance factor, B activation bytes):

  T  = b * s / (cp * ulysses * (tp if sp else 1))  tokens entering the MoE block on this rank
  R  = rho * T * k                     rows the busiest rank's local experts receive (rho capped
                                       at the capacity factor when tokens are dropped)
  router          2 T h E FLOPs (GEMM [T, h] x [h, E])
  routed experts  E/e local experts, each with t R / (E/e) rows after the ETP all-gather:
                  fc1 [rows, h] x [h, u f / t], fc2 [rows, f / t] x [f / t, h]
                  (2 R h f (u + 1) FLOPs in all), each GEMM at its own smallest dimension's
                  efficiency (few tokens per expert run below peak)
  shared experts  a dense MLP of width f_s, TP-sharded (tokens of the whole TP group)
  elementwise     activation over R f and rows f_s / tp, 4 passes of R h (permute, unpermute)
  dispatch/combine  two all-to-alls over the EP group of R (h B + 4) bytes each way (tokens and
                  their fp32 probabilities); the EP group's ranks are t apart (Megatron's expert
                  rank order: etp innermost), so it stays on NVLink while e t <= GPUs per node,
                  and its inter-node share runs at `ClusterSpec.all_to_all_inter_efficiency` of
                  the network bandwidth (2, 4, 8+ nodes) under the alpha-beta model
  ETP             all-gather of [t R, h] over etp in dispatch, reduce-scatter in combine, plus
                  the all-gather of the E per-expert counts over t e ranks (latency)
  TP              the attention block's all-gather/reduce-scatter as in a dense layer; the MLP
                  block has its own only with shared experts (the routed experts use ETP)
  backward        2x the GEMMs and elementwise, the same communication again
  parameters      dense part (attention, norms, shared experts) / tp, router E h (replicated),
                  routed experts E h f (u + 1) / (e t); dense part reduced and ZeRO-sharded over
                  d = dp cp ulysses (stride tp), experts over expert-DP = width / (e t)
                  (stride e t)
  activations     the dense layer's attention part, plus fc1 input t R h, fc1 output R u f,
                  fc2 input R f (the routing probabilities multiply the activation inside the
                  experts, experts.py:680-746 and 112-117, so the combine's unpermute saves
                  nothing: token_dispatcher.py:319, 833), routing state 5 T E (fp32
                  probabilities, bool map) + 12 T k (top-k indices int64, scores fp32) + 12 R
                  (the receive side's sort indices int64, permuted probabilities fp32), and the
                  shared experts' intermediates rows (u + 1) f_s / tp; `moe_activation_bytes`
                  (tools/bench_memory.py measures it per layer at the measured R)

megatron-core 0.16.1 sites: transformer/moe/token_dispatcher.py:348-850 (alltoall dispatcher),
experts.py:820-925 (SequentialMLP), router.py:81-101 (gating), shared_experts.py,
tensor_parallel/layers.py:829 (expert parameters reduced over expert-DP).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatron_ext.planner.cost import compute as C
from megatron_ext.planner.cost.comm import AlphaBetaComm, ArrayLike
from megatron_ext.planner.cost.compute import (  # noqa: F401  (the MoE shape, re-exported)
    _u,
    dense_mlp_params,
    expert_params,
    moe_flops_per_token,
    moe_layer_params,
    moe_model_parameters,
    router_params,
    shared_expert_params,
)
from megatron_ext.planner.cost.fp8 import moe_fp8_delta_s
from megatron_ext.planner.cost.memory import (
    layer_activation_bytes,
    layer_transient_bytes,
    unfused_activation_bytes,
)
from megatron_ext.planner.cost.memory import state_bytes_per_param as _per_param
from megatron_ext.planner.cost.model import CostModel, LayerCosts
from megatron_ext.planner.space import StrategyTable
from megatron_ext.specs import FP8Spec, LinkSpec, ModelSpec

DENSE, MOE = 0, 1
"""Layer kinds: the index of a kind's costs in `kind_costs`."""
BF16 = 2
"""Added to the kind of a layer an FP8 run keeps in bf16 (FP8Spec.layer_in_fp8 false): kinds
DENSE + BF16 and MOE + BF16, priced without FP8 (planner/cost/fp8.py)."""


# ---- model shape ----------------------------------------------------------------------------


def layer_kinds(model: ModelSpec, fp8: FP8Spec | None = None) -> np.ndarray:  # [L]
    """DENSE / MOE per layer, + BF16 where an FP8 run keeps the layer in bf16."""
    kinds = np.array([MOE if model.is_moe_layer(i) else DENSE for i in range(model.num_layers)],
                     dtype=np.int64)
    if fp8 is not None:
        kinds += BF16 * ~np.array(fp8.fp8_layers(model.num_layers), dtype=bool)
    return kinds


def is_moe_kind(kind: int) -> bool:
    return kind % BF16 == MOE


# ---- costs ----------------------------------------------------------------------------------


def imbalance(model: ModelSpec, rho: float) -> float:
    """Effective load factor: rho, capped by the capacity factor when tokens are dropped."""
    assert model.moe is not None
    cf = model.moe.capacity_factor
    return min(rho, cf) if cf > 0 else rho


def _gemm_s(profile: C.ComputeProfile, tokens: ArrayLike, k: ArrayLike, n: ArrayLike,
            peak: float) -> ArrayLike:
    smallest = np.minimum(np.minimum(tokens, k), n)
    return 2.0 * tokens * k * n / (peak * C.gemm_efficiency(profile, smallest))


def ep_all_to_all_s(cm: CostModel, num_bytes: np.ndarray, ep: np.ndarray, stride: np.ndarray
                    ) -> np.ndarray:
    """One all-to-all of `num_bytes` per rank's send buffer over EP groups of ranks `stride`
    apart. Under the alpha-beta model a group spanning n nodes sends its inter-node share at
    inter_node bandwidth x all_to_all_inter_efficiency[n] (2, 4, 8+ nodes); a measured comm
    model (hardware profile) answers as measured."""
    num_bytes = np.broadcast_to(np.asarray(num_bytes, dtype=float), np.shape(ep))
    out = np.zeros(np.shape(ep))
    eff = cm.cluster.all_to_all_inter_efficiency
    for e, st in set(zip(np.asarray(ep).tolist(), np.asarray(stride).tolist())):
        if e == 1:
            continue
        sel = (ep == e) & (stride == st)
        layout = cm.layout(e, st)
        comm = cm.comm
        if isinstance(comm, AlphaBetaComm) and layout.crosses_nodes:
            share = eff[min(max(0, int(np.ceil(np.log2(layout.num_nodes))) - 1), len(eff) - 1)]
            inter = cm.cluster.inter_node
            comm = AlphaBetaComm(cluster=dataclasses.replace(cm.cluster, inter_node=LinkSpec(
                bandwidth_bytes_per_s=inter.bandwidth_bytes_per_s * share,
                latency_s=inter.latency_s)))
        out[sel] = comm.time_s("all_to_all", num_bytes[sel], layout)
    return out


def moe_layer_costs(cm: CostModel, table: StrategyTable, micro_batch_size: int) -> LayerCosts:
    """LayerCosts of one MoE layer under every strategy of `table` (module docstring).
    Strategies an MoE layer cannot use (tp > 1 without sp) are priced as if they could; the
    search masks them (`valid_for`)."""
    m, t, moe = cm.model, cm.training, cm.model.moe
    assert moe is not None
    e_b = cm.element_bytes
    h, E, k = m.hidden_size, moe.num_experts, moe.router_topk
    f, f_s, f_d, u = moe.expert_ffn_hidden_size(m), moe.shared_expert_intermediate_size, \
        m.ffn_hidden_size, _u(m)
    tp, ep, et = table.tp, table.ep, table.etp
    b = micro_batch_size / table.dp
    shards = table.cp * table.ulysses
    rows = b * t.seq_length / shards
    sp_div = np.where(table.sp, tp, 1)
    tokens = rows / sp_div
    rho = imbalance(m, t.moe_imbalance)
    recv = rho * tokens * k
    peak = cm.cluster.peak_flops * (1.0 if e_b == 2 else cm.compute.fp32_flops_ratio)
    hbm = cm.compute.hbm_for(cm.cluster)
    prof = cm.compute
    fused = cm.fused_softmax(table, b)
    comp = C.layer_compute(m, cm.cluster, prof, b=b, seq_length=t.seq_length, tp=tp,
                           sp=table.sp, seq_shards=shards, element_bytes=e_b,
                           flash_attention=t.flash_attention, fused_softmax=fused)
    passes = 3.0 if u == 2 else 2.0
    # The dense MLP this layer does not have (layer_gemms' MLP GEMMs and its activation pass).
    dense_mlp = (_gemm_s(prof, rows, h, u * f_d / tp, peak) + _gemm_s(prof, rows, f_d / tp, h, peak)
                 + e_b * passes * rows * f_d / tp / hbm)
    local = E / ep
    per_expert = et * recv / local
    experts = local * (_gemm_s(prof, per_expert, h, u * f / et, peak)
                       + _gemm_s(prof, per_expert, f / et, h, peak))
    router = _gemm_s(prof, tokens, h, float(E), peak)
    shared: ArrayLike = 0.0
    if f_s:
        shared = (_gemm_s(prof, rows, h, u * f_s / tp, peak)
                  + _gemm_s(prof, rows, f_s / tp, h, peak))
    elem = e_b * (passes * (recv * f + rows * f_s / tp) + 4.0 * recv * h) / hbm
    moe_f = router + experts + shared + elem
    attn_f = comp.forward_s - dense_mlp
    attn_b = comp.backward_s - 2.0 * dense_mlp
    if t.fp8 is not None:  # an FP8 layer: its weight GEMMs at the FP8 GEMM model
        d_f, d_b = moe_fp8_delta_s(cm, table, rows=rows, per_expert=per_expert, local=local)
        attn_f, attn_b = attn_f + d_f, attn_b + d_b
    # Communication, one way (forward; backward repeats it).
    hidden_bytes = rows * h * e_b
    tp_block = np.where(table.sp, cm.collective_s("all_gather", hidden_bytes, tp, 1)
                        + cm.collective_s("reduce_scatter", hidden_bytes, tp, 1),
                        cm.collective_s("all_reduce", hidden_bytes, tp, 1))
    tp_one_way = (2 if f_s else 1) * tp_block
    uly_bytes = rows * (2 * C.q_dim(m) + 2 * C.kv_dim(m)) / tp * e_b
    uly_one_way = cm.collective_s("all_to_all", uly_bytes, table.ulysses, tp * table.cp)
    a2a = 2 * ep_all_to_all_s(cm, recv * (h * e_b + 4.0), ep, et)
    etp = 2 * cm.collective_s("all_gather", et * recv * h * e_b, et, 1)
    meta = cm.collective_s("all_gather", 8.0 * E * et * ep, et * ep, 1)
    expert_comm = a2a + etp + meta
    cp_fwd, cp_bwd = cm._cp_exposed_s(table, rows, comp)
    one_way = tp_one_way + uly_one_way + expert_comm
    rc_full = table.recompute == 2
    # Host floor of each pass (compute.host_bound_s) with the dense layer's kernel count: a
    # lower bound, the router and token dispatch launch more.
    host_f, host_b, host_attn = C.layer_host_s(
        m, prof.host_for(cm.cluster), tp=tp, flash_attention=t.flash_attention,
        dropout=t.dropout, fused_softmax=fused, forward_kernels=prof.layer_forward_kernels,
        backward_kernels=prof.layer_backward_kernels)
    k_host = prof.host_overlap_power
    recompute = np.where(
        rc_full, C.host_bound_s(attn_f + moe_f + one_way + cp_fwd, host_f, k_host), 0.0)
    recompute = recompute + np.where(
        table.recompute == 1, C.host_bound_s(comp.attention_forward_s, host_attn, k_host), 0.0)
    # Parameters per GPU: the dense part over d (stride tp), the experts over expert-DP.
    dense_params = ((C.layer_params(m) - dense_mlp_params(m) + shared_expert_params(m)) / tp
                    + router_params(m))
    exp_params = expert_params(m) / (ep * et)
    d, edp = table.shard_ranks, table.expert_dp
    fwd_c, bwd_c = attn_f + moe_f, attn_b + 2.0 * moe_f + recompute
    z3f_d, z3b_d, sync_d, gather_d = cm._data_parallel_s(table, fwd_c, bwd_c,
                                                         params=dense_params)
    z3f_e, z3b_e, sync_e, gather_e = cm._data_parallel_s(
        table, fwd_c, bwd_c, params=exp_params, shard_ranks=edp, stride=ep * et)
    z3_fwd, z3_bwd = z3f_d + z3f_e, z3b_d + z3b_e
    fwd = C.host_bound_s(attn_f + moe_f + one_way + cp_fwd + z3_fwd, host_f, k_host)
    accumulate = cm.grad_accumulate_s(dense_params + exp_params)
    bwd = C.host_bound_s(attn_b + 2.0 * moe_f + one_way + cp_bwd + z3_bwd + accumulate, host_b,
                         k_host) + recompute
    comm = 2 * one_way + cp_fwd + cp_bwd + z3_fwd + z3_bwd + np.where(rc_full,
                                                                      one_way + cp_fwd, 0.0)
    sharded = np.where(table.zero >= 1, 1, 0)
    optimizer = C.optimizer_step_s(
        dense_params / np.where(sharded, d, 1) + exp_params / np.where(sharded, edp, 1),
        cm.cluster, cm.compute)
    # Memory.
    def act_of(recompute_codes: np.ndarray) -> np.ndarray:
        return moe_activation_bytes(m, table, b=b, seq_length=t.seq_length, recv=recv,
                                    recompute=recompute_codes, element_bytes=e_b,
                                    flash_attention=t.flash_attention, dropout=t.dropout)

    act = act_of(table.recompute)
    act_none = act_of(np.zeros_like(table.recompute))
    half, states = t.half_precision, t.num_optimizer_states
    hg = t.keeps_half_grads
    state = (dense_params * _per_param(table.zero, d, half_precision=half,
                                       num_optimizer_states=states, half_grads=hg)
             + exp_params * _per_param(table.zero, edp, half_precision=half,
                                       num_optimizer_states=states, half_grads=hg))
    transient = layer_transient_bytes(act_none, act, zero=table.zero,
                                      params_per_gpu=dense_params + exp_params,
                                      element_bytes=e_b,
                                      zero3_live_params=cm.zero3_live_params)
    return LayerCosts(
        forward_s=np.asarray(fwd, dtype=float),
        backward_s=np.asarray(bwd, dtype=float),
        recompute_s=np.asarray(recompute, dtype=float),
        comm_s=np.asarray(comm, dtype=float),
        grad_sync_s=np.asarray(sync_d + sync_e, dtype=float),
        param_gather_s=np.asarray(gather_d + gather_e, dtype=float),
        optimizer_s=np.asarray(optimizer, dtype=float),
        state_bytes=np.asarray(state, dtype=float),
        activation_bytes=act,
        transient_bytes=np.asarray(transient, dtype=float),
    )


def moe_activation_bytes(model: ModelSpec, table: StrategyTable, *, b: ArrayLike,
                         seq_length: int, recv: ArrayLike, recompute: ArrayLike,
                         element_bytes: int, flash_attention: bool, dropout: bool) -> np.ndarray:
    """Bytes one MoE layer keeps for its backward, per micro-batch on one GPU (module docstring):
    the dense layer's (`layer_activation_bytes`) with its MLP intermediates swapped for the
    routed experts' (R = `recv` rows received by this rank's local experts) and the shared
    experts'; full recomputation keeps the layer input alone."""
    moe = model.moe
    assert moe is not None
    e, h, E, k, u = element_bytes, model.hidden_size, moe.num_experts, moe.router_topk, _u(model)
    f, f_s, f_d = moe.expert_ffn_hidden_size(model), moe.shared_expert_intermediate_size, \
        model.ffn_hidden_size
    tp, et = table.tp, table.etp
    rows = b * seq_length / (table.cp * table.ulysses)
    tokens = rows / np.where(table.sp, tp, 1)
    routed = (e * (et * recv * h + recv * (u + 1) * f)
              + 5.0 * tokens * E + 12.0 * tokens * k + 12.0 * recv)
    swap = routed + e * rows * (u + 1) * (f_s - f_d) / tp  # shared experts for the dense MLP
    dense = layer_activation_bytes(
        model, b=b, seq_length=seq_length, tp=tp, sp=table.sp, cp=table.cp,
        ulysses=table.ulysses, recompute=recompute, element_bytes=e,
        flash_attention=flash_attention, dropout=dropout)
    return np.asarray(dense + np.where(np.asarray(recompute) == 2, 0.0, swap), dtype=float)


def moe_unfused_bytes(model: ModelSpec, table: StrategyTable, *, b: ArrayLike, seq_length: int,
                      recv: ArrayLike, recompute: ArrayLike, element_bytes: int,
                      dropout: bool) -> np.ndarray:
    """What the unfused local MoE layer (megatron-core's SequentialMLP, this package's CPU
    runtime) keeps beyond `moe_activation_bytes`: the dense layer's unfused term
    (memory.unfused_activation_bytes) with its SwiGLU pair over the shared experts' width
    instead of the dense MLP's, plus per routed row the activation's output before the
    probabilities multiply it and, under SwiGLU, the gate's activation and the gated product:
    (3 if swiglu else 1) [R, f] (tools/bench_memory.py)."""
    moe = model.moe
    assert moe is not None
    e, u = element_bytes, _u(model)
    f, f_s, f_d = moe.expert_ffn_hidden_size(model), moe.shared_expert_intermediate_size, \
        model.ffn_hidden_size
    tp = table.tp
    rows = b * seq_length / (table.cp * table.ulysses)
    dense = unfused_activation_bytes(
        model, b=b, seq_length=seq_length, tp=tp, sp=table.sp, cp=table.cp,
        ulysses=table.ulysses, recompute=recompute, element_bytes=e, dropout=dropout)
    swiglu_pair = 2.0 * e * rows * (f_s - f_d) / tp if u == 2 else 0.0
    routed = (3.0 if u == 2 else 1.0) * e * recv * f
    return np.asarray(dense + np.where(np.asarray(recompute) == 2, 0.0, swiglu_pair + routed),
                      dtype=float)


def valid_for(model: ModelSpec, table: StrategyTable) -> np.ndarray:  # [K, S] bool
    """Which strategies each layer kind may use: dense layers only ep = 1 without etp; MoE
    layers the plan's rules (plan_checks._check_experts: ep | E, ep etp | width, etp | f, sp
    with tp > 1), not ep = 1 with etp != tp (megatron-core 0.16.1 then never reduces the
    expert gradients over expert-DP: reference M1.6), and ZeRO 0/1 only (the layerwise runtime
    refuses ZeRO-2/3 on MoE layers)."""
    ep, et = table.ep, table.etp
    has_etp = np.array([s.etp is not None for s in table.strategies], dtype=bool)
    dense = (ep == 1) & ~has_etp
    if model.moe is None:
        return np.stack([dense] * 4)
    f = model.moe.expert_ffn_hidden_size(model)
    width = table.tp * table.shard_ranks
    moe = ((model.moe.num_experts % ep == 0) & (width % (ep * et) == 0) & (f % et == 0)
           & ((table.tp == 1) | table.sp) & ~((ep == 1) & (et != table.tp))
           & (table.zero <= 1))
    return np.stack([dense, moe, dense, moe])  # DENSE, MOE, and their + BF16 kinds


def kind_costs(cm: CostModel, table: StrategyTable, micro_batch_size: int) -> list[LayerCosts]:
    """LayerCosts of `table` per layer kind: [dense, MoE] ([dense] for a dense model); in an
    FP8 run that keeps layers in bf16, [dense, MoE, dense bf16, MoE bf16] (a dense model's
    MoE entries repeat the dense ones and are never used)."""
    dense = cm.layer_costs(table, micro_batch_size)
    per = [dense] if cm.model.moe is None else [dense, moe_layer_costs(cm, table,
                                                                       micro_batch_size)]
    fp8 = cm.training.fp8
    if fp8 is None or all(fp8.fp8_layers(cm.model.num_layers)):
        return per
    bf16 = kind_costs(cm.without_fp8(), table, micro_batch_size)
    return (per * 2)[:2] + (bf16 * 2)[:2]


def per_layer_costs(cm: CostModel, table: StrategyTable, micro_batch_size: int,
                    index: np.ndarray) -> LayerCosts:
    """LayerCosts with one row per layer: layer i priced under table strategy index[i] as its
    kind (dense or MoE, FP8 or kept in bf16)."""
    per = kind_costs(cm, table, micro_batch_size)
    index = np.asarray(index, dtype=np.int64)
    if len(per) == 1:
        return LayerCosts(**{n: getattr(per[0], n)[index] for n in LayerCosts.__slots__})
    kinds = layer_kinds(cm.model, cm.training.fp8)[: len(index)]
    return LayerCosts(**{
        n: np.stack([getattr(c, n)[index] for c in per])[kinds, np.arange(len(index))]
        for n in LayerCosts.__slots__
    })


def per_layer_weight_grad_bytes(cm: CostModel, table: StrategyTable, index: np.ndarray
                                ) -> tuple[np.ndarray, np.ndarray]:
    """(weights, gradients) bytes per GPU of each layer (rows as `per_layer_costs`), the
    parts of its state bytes that memory.state_bytes_breakdown names; the rest is optimizer."""
    from megatron_ext.planner.cost.memory import state_bytes_breakdown

    t, m = cm.training, cm.model
    half, states = t.half_precision, t.num_optimizer_states
    w_d, g_d, _ = state_bytes_breakdown(table.zero, table.shard_ranks, half_precision=half,
                                        num_optimizer_states=states, half_grads=t.keeps_half_grads)
    params = cm.layer_params / table.tp
    weights, grads = params * np.asarray(w_d), params * np.asarray(g_d)
    index = np.asarray(index, dtype=np.int64)
    if m.moe is None:
        return weights[index], grads[index]
    w_e, g_e, _ = state_bytes_breakdown(table.zero, table.expert_dp, half_precision=half,
                                        num_optimizer_states=states, half_grads=t.keeps_half_grads)
    dense_params = ((C.layer_params(m) - dense_mlp_params(m) + shared_expert_params(m))
                    / table.tp + router_params(m))
    exp_params = expert_params(m) / (table.ep * table.etp)
    moe_w = dense_params * np.asarray(w_d) + exp_params * np.asarray(w_e)
    moe_g = dense_params * np.asarray(g_d) + exp_params * np.asarray(g_e)
    kinds = layer_kinds(m)[: len(index)] == MOE
    return (np.where(kinds, moe_w[index], weights[index]),
            np.where(kinds, moe_g[index], grads[index]))
