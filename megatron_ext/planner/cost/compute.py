"""Compute cost: FLOPs of each layer part and the time they take at a given efficiency.

Legend: b = samples per data-parallel replica, s = sequence length, m = tokens one GPU feeds
through its linear layers (b * s / (cp * ulysses)), h = hidden, q = heads * head_dim,
kv = query_groups * head_dim, f = ffn hidden, V = padded vocabulary, t = tp.
Functions are vectorised: degrees and token counts may be numpy arrays of strategies.

Time = GEMM FLOPs / (peak * gemm efficiency) + attention FLOPs / (peak * attention efficiency)
+ elementwise bytes / HBM bandwidth, per layer pass (forward, recomputed forward, backward) no
less than the host time to issue its kernels: the soft maximum (gpu^k + host^k)^(1/k) with
host = kernels x HostConstants.kernel_s + tensor-parallel ring steps x collective_step_s (a
GPU preset's constants, HOST_CONSTANTS; `host_bound_s`). Small models and micro-batches are
host-bound: vTrain's single-node sweeps cost ~3 ms per layer and micro-batch at micro-batch 1
whatever the hidden size. Each weight GEMM's efficiency saturates with its own
smallest dimension (small TP shards and few tokens run below peak). Backward GEMMs cost 2x
forward FLOPs; flash attention backward costs 2.5x its forward (it recomputes the scores);
unfused attention computes the whole s x s score matrix and moves it through HBM. A model
profile (`ComputeProfile`) replaces the efficiencies and the HBM bandwidth. The defaults are
checked against 55 published A100 runs (tools/bench_published.py, docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from megatron_ext.errors import PlanError
from megatron_ext.planner.cost import mla
from megatron_ext.schema import expect_object, get_float, reject_unknown
from megatron_ext.specs import ClusterSpec, ModelSpec

ArrayLike = float | np.ndarray

# Measured-class HBM bandwidths of the preset GPUs (bytes/s); other clusters use peak / 300.
_HBM_BYTES_PER_S = {
    "dgx-a100-40g": 1.55e12,
    "dgx-a100-80g": 2.0e12,
    "dgx-h100": 3.35e12,
    "dgx-h200": 4.8e12,
    "dgx-b200": 7.7e12,  # B200 data sheet 7.7-8 TB/s (HGX B200)
    "gb200-nvl72": 8.0e12,  # GB200 NVL72 data sheet, 8 TB/s per GPU
    "gb300-nvl72": 8.0e12,  # GB300 NVL72 data sheet, 8 TB/s per GPU
}


# ---- fixed host-side costs (fitted: tools/fit_gpu_constants.py, docs/benchmarks.md) --------


@dataclass(frozen=True, kw_only=True, slots=True)
class HostConstants:
    """Fixed host-side costs of one GPU preset's software stack (see `host_bound_s`)."""

    kernel_s: float = 0.0
    """Host seconds to issue one kernel of a transformer layer pass (eager dispatch, autograd,
    launch)."""
    collective_step_s: float = 0.0
    """Host-side seconds per ring step of a tensor-parallel collective: each collective waits
    for the slowest of its t ranks, (t - 1) steps per reduce or gather phase."""
    microbatch_s: float = 0.0
    """Fixed seconds per micro-batch on every pipeline stage (schedule step, data, loss)."""


A100_HOST = HostConstants(kernel_s=52.5e-6, collective_step_s=5e-6, microbatch_s=0.25e-3)
"""Fitted on vTrain's 1,440 single-node runs (github:VIA-Research/vTrain
data/ground_truth_single.csv @ f8dda8473a48; Bang et al., MICRO-57 2024): 8 GPT models of
0.2-1.3B (h 1024 / 2048, 12-24 layers, seq 1024) on 2, 4 and 8 A100 of one node,
Megatron-DeepSpeed, fp16, full recomputation, every TP x PP x DP x micro-batch. There a layer
costs 3.0-3.5 ms per micro-batch at micro-batch 1 whatever the hidden size (slope of the
iteration time over layers x micro-batches, TP 1-4), ~5 ms at TP 8, and the time grows with the
micro-batch only once compute passes that floor. Least squares on log(predicted / measured) over
the 1,440 runs (tools/fit_gpu_constants.py: the best point of its grids; the least-squares
optimum off them, 49 us / 8.7 us / 1.0 ms / k 3.0, fits the runs' tails a little better and
ranks their layouts worse): 52.5 us per kernel (15 forward, 30 backward and 15 recomputed
kernels of an unfused GPT layer: 3.15 ms per layer and micro-batch), 5 us per tensor-parallel
ring step, 0.25 ms per micro-batch and stage, soft-maximum power 3.25 (HOST_OVERLAP_POWER).
They were fitted with NCCL's tuning model for the collectives; with the node's measured
all-reduce (measured_nccl.py) the grid's best point is 50 us / 5 us / 1.25 ms / k 3.0 (mean
squared log error 0.0071 against these 0.0076), which moves the other sources' held-out median
|error| from 3.6% to 4.5% and ranks one sweep fewer, so these stay.
Checked on the runs it was not fitted on: vTrain's 108 multi-node runs (3.6-175B on 64-512
A100), NVIDIA's Megatron-LM runs (SC'21, Korthikanti et al., NeMo, Megatron-LM 2020) and BLOOM's
(docs/benchmarks.md)."""

HOST_CONSTANTS: dict[str, HostConstants] = {
    "dgx-a100-40g": A100_HOST,
    "dgx-a100-80g": A100_HOST,
    # No public sweep of small layouts on H100/H200 was found: the A100 node's host constants
    # (same software stack, a host CPU of the same class) until one is.
    "dgx-h100": A100_HOST,
    "dgx-h200": A100_HOST,
    # Blackwell presets: likewise unchecked until a public sweep of small layouts exists.
    "dgx-b200": A100_HOST,
    "gb200-nvl72": A100_HOST,
    "gb300-nvl72": A100_HOST,
}
"""Per GPU preset; other clusters (custom specs, measured CPU clusters) have none unless the
compute profile sets them."""

FP8_GEMM_EFFICIENCY = 0.6
"""Share of the FP8 peak a large FP8 GEMM reaches. An assumption to calibrate on measured FP8
runs (fp8.md section 4: no public shape sweep; MLPerf Training v5.0's 405B runs reach 39-44% of
the FP8 peak end to end on H100, which with the non-GEMM work puts the GEMMs near 0.6-0.7)."""


HOST_OVERLAP_POWER = 3.25
"""k of the soft maximum (gpu^k + host^k)^(1/k) of a pass (fitted with A100_HOST)."""


ZERO_MEANS_DEFAULT = frozenset({"hbm_bytes_per_s", "layer_forward_kernels",
                                "layer_backward_kernels", "layer_extra_elementwise_passes"})
"""ComputeProfile fields whose 0 stands for the cost model's own figure."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeProfile:
    """Efficiencies of the GPU on this model's kernels; a model profile overrides the defaults."""

    gemm_efficiency: float = 0.72
    """Fraction of dense peak a large GEMM reaches. Calibrated on the 55 published A100 runs
    (tools/bench_published.py, docs/benchmarks.md): a grid over (0.68-0.80) x gemm_half_dim
    (64-256) x attention_efficiency (0.55, 0.65) puts 0.72 / 128 / 0.55 at the lowest median
    |error|; the rows that pin it are the single-GPU and single-node TP runs without
    communication to hide (Megatron-LM README 2020 mp1-mp8, Korthikanti et al. 22B) and the
    PTD-P runs of SC'21 Tables 1-2."""
    gemm_half_dim: float = 128.0
    """A GEMM whose smallest dimension is x reaches gemm_efficiency * x / (x + gemm_half_dim)."""
    attention_efficiency: float = 0.55
    """Fraction of peak of fused (flash) attention forward."""
    attention_backward_efficiency: float = 0.45
    """Fraction of peak of fused attention backward."""
    hbm_bytes_per_s: float = 0.0
    """Achievable HBM bandwidth for elementwise kernels; 0 means a guess from the cluster."""
    fp32_flops_ratio: float = 0.5
    """Peak of fp32 (TF32) GEMMs relative to bf16 peak."""
    fp8_gemm_efficiency: float = FP8_GEMM_EFFICIENCY
    """Share of the FP8 peak a large FP8 GEMM reaches (planner/cost/fp8.py; the FP8 rows of
    tools/bench_published.py refit it leave-one-source-out)."""
    host_kernel_s: float = -1.0
    """Host seconds per kernel of a layer pass (HostConstants.kernel_s); -1: the cluster
    preset's (HOST_CONSTANTS), 0: no host floor (measured model profiles already contain it)."""
    host_collective_step_s: float = -1.0
    """Host seconds per tensor-parallel ring step (HostConstants.collective_step_s); -1: the
    preset's."""
    host_microbatch_s: float = -1.0
    """Fixed seconds per micro-batch and stage (HostConstants.microbatch_s); -1: the preset's."""
    host_overlap_power: float = HOST_OVERLAP_POWER
    """k of the soft maximum (gpu^k + host^k)^(1/k) of a pass's GPU and host time. 1 is a run
    with synchronous launches (CUDA_LAUNCH_BLOCKING=1): each launch returns only once its
    kernel has finished, so the host issues the next kernel while the GPU idles and the two
    times add."""
    layer_forward_kernels: float = 0.0
    """Kernels one GPU launches in a layer's forward, tensor-parallel collectives not counted;
    0: Megatron-Core's fused layer (`layer_forward_kernels`). An implementation that runs the
    rotary embedding, the activation or layout copies as separate ops states its own count."""
    layer_backward_kernels: float = 0.0
    """Kernels of a layer's backward per micro-batch, with any the optimizer wrapper launches
    per micro-batch (a cast-and-add of each gradient into an fp32 copy); 0:
    BACKWARD_KERNELS_PER_FORWARD x the forward's."""
    layer_extra_elementwise_passes: float = 0.0
    """HBM passes over a [tokens, hidden / tp] tensor that such an implementation's forward
    makes beyond the fused layer's (`layer_elementwise_bytes`): an unfused rotary embedding,
    activation or layout copies; the backward makes twice as many."""

    @classmethod
    def from_dict(cls, data: Any, path: str = "compute") -> ComputeProfile:
        data = expect_object(data, path)
        reject_unknown(data, set(cls.__dataclass_fields__), path)
        defaults = cls()
        values = {}
        for name in cls.__dataclass_fields__:
            host = name.startswith("host_") and name != "host_overlap_power"
            value = get_float(data, name, path, default=getattr(defaults, name),
                              positive=not host and name not in ZERO_MEANS_DEFAULT)
            if host and name in data and value < 0:
                raise PlanError(f"{path}.{name}={value} must be >= 0 seconds (0 turns it off; "
                                "leave it out for the cluster preset's value)")
            if name in ZERO_MEANS_DEFAULT and value < 0:
                raise PlanError(f"{path}.{name}={value} must be >= 0 (0 or left out: the cost "
                                "model's own figure)")
            values[name] = value
        return cls(**values)

    def host_for(self, cluster: ClusterSpec) -> HostConstants:
        """The host constants on `cluster`: this profile's where set (>= 0), else the preset's
        (none for clusters that are not GPU presets)."""
        return _host_for(self, cluster.name)

    def hbm_for(self, cluster: ClusterSpec) -> float:
        if self.hbm_bytes_per_s > 0:
            return self.hbm_bytes_per_s
        return _HBM_BYTES_PER_S.get(cluster.name, cluster.peak_flops / 300.0)


@functools.lru_cache(maxsize=64)
def _host_for(profile: ComputeProfile, cluster_name: str) -> HostConstants:
    preset = HOST_CONSTANTS.get(cluster_name, HostConstants())
    return HostConstants(
        kernel_s=profile.host_kernel_s if profile.host_kernel_s >= 0 else preset.kernel_s,
        collective_step_s=(profile.host_collective_step_s
                           if profile.host_collective_step_s >= 0 else preset.collective_step_s),
        microbatch_s=(profile.host_microbatch_s if profile.host_microbatch_s >= 0
                      else preset.microbatch_s),
    )


# ---- model shape ----------------------------------------------------------------------------


def q_dim(model: ModelSpec) -> int:
    return model.num_attention_heads * model.head_dim


def kv_dim(model: ModelSpec) -> int:
    return model.num_query_groups * model.head_dim


def attention_dim(model: ModelSpec) -> float:
    """The q of the causal attention FLOPs 2 b s^2 q (MLA: its query and value widths' mean)."""
    return q_dim(model) if model.mla is None else mla.attention_dim(model)


def layer_matmul_params(model: ModelSpec) -> int:
    """Weights of one transformer layer's GEMMs: QKV, output projection, MLP."""
    h, f = model.hidden_size, model.ffn_hidden_size
    attention = h * (q_dim(model) + 2 * kv_dim(model)) + q_dim(model) * h
    if model.mla is not None:
        attention = mla.attention_matmul_params(model)
    mlp = h * f * (3 if model.activation == "swiglu" else 2)
    return attention + mlp


def layer_params(model: ModelSpec) -> int:
    """All parameters of one transformer layer (GEMMs, biases, norms)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    norms = 2 * h * (2 if model.normalization == "LayerNorm" else 1)
    biases = 0
    if model.add_bias_linear:
        biases = (
            q_dim(model)
            + 2 * kv_dim(model)
            + h
            + f * (2 if model.activation == "swiglu" else 1)
            + h
        )
    if model.add_qkv_bias and not model.add_bias_linear:
        biases = q_dim(model) + 2 * kv_dim(model)
    if model.qk_layernorm:  # one norm over head_dim for queries, one for keys
        norms += 2 * model.head_dim * (2 if model.normalization == "LayerNorm" else 1)
    if model.mla is not None:  # MLA attention, MLP biases, the two layer norms
        mlp_bias = (f * (2 if model.activation == "swiglu" else 1) + h
                    if model.add_bias_linear else 0)
        return (mla.attention_params(model) + h * f * (3 if model.activation == "swiglu" else 2)
                + mlp_bias + 2 * h * (2 if model.normalization == "LayerNorm" else 1))
    return layer_matmul_params(model) + norms + biases


def model_parameters(model: ModelSpec) -> int:
    """All parameters, unpadded vocabulary: layers, embedding, output layer (untied), learned
    positions, final norm. MoE models: every expert counts (cost/moe.py)."""
    if model.moe is not None:
        return moe_model_parameters(model)
    h = model.hidden_size
    embedding = model.vocab_size * h * (1 if model.tied_embeddings else 2)
    learned = model.position_embedding == "learned_absolute"
    positions = model.max_position_embeddings * h if learned else 0
    final_norm = h * (2 if model.normalization == "LayerNorm" else 1)
    return model.num_layers * layer_params(model) + embedding + positions + final_norm


def model_flops_per_token(model: ModelSpec, seq_length: int) -> float:
    """Training FLOPs per token for MFU: 6 x (layer GEMM weights + output layer) plus causal
    attention 6 * s * q per layer (half of the s x s score matrix); recomputation not counted.
    MoE layers count the weights a token uses (router, shared and top-k experts; cost/moe.py)."""
    if model.moe is not None:
        return moe_flops_per_token(model, seq_length)
    per_layer = 6 * layer_matmul_params(model) + 6 * seq_length * attention_dim(model)
    return model.num_layers * per_layer + 6 * model.hidden_size * model.vocab_size


# ---- Mixture of Experts: parameters and FLOPs (their costs: cost/moe.py) ----------------------


def _num_moe_layers(model: ModelSpec) -> int:
    return sum(model.is_moe_layer(i) for i in range(model.num_layers))


def _u(model: ModelSpec) -> int:  # gated MLPs (swiglu) have two input branches
    return 2 if model.activation == "swiglu" else 1


def dense_mlp_params(model: ModelSpec) -> int:
    """The dense MLP weights an MoE layer replaces: h f (u + 1)."""
    return model.hidden_size * model.ffn_hidden_size * (_u(model) + 1)


def expert_params(model: ModelSpec) -> int:
    """All routed experts of one MoE layer: E h f (u + 1)."""
    moe = model.moe
    assert moe is not None
    f = moe.expert_ffn_hidden_size(model)
    return moe.num_experts * model.hidden_size * f * (_u(model) + 1)


def router_params(model: ModelSpec) -> int:
    assert model.moe is not None
    return model.moe.num_experts * model.hidden_size


def shared_expert_params(model: ModelSpec) -> int:
    """The shared experts' MLP (h f_s (u + 1)) and, when gated (Qwen2-MoE), its gate [1, h]."""
    assert model.moe is not None
    gate = model.hidden_size if model.moe.shared_expert_gate else 0
    return model.hidden_size * model.moe.shared_expert_intermediate_size * (_u(model) + 1) + gate


def moe_layer_params(model: ModelSpec, *, active: bool = False) -> int:
    """Parameters of one MoE layer: all of them, or those one token uses (top-k experts)."""
    assert model.moe is not None
    experts = expert_params(model)
    if active:
        experts = experts * model.moe.router_topk // model.moe.num_experts
    base = layer_params(model) - dense_mlp_params(model)
    return base + router_params(model) + shared_expert_params(model) + experts


def moe_model_parameters(model: ModelSpec, *, active: bool = False) -> int:
    """All parameters of an MoE model (or the active ones: top-k experts per MoE layer)."""
    n_moe = _num_moe_layers(model)
    dense_total = model_parameters(dataclasses.replace(model, moe=None))
    per_moe = moe_layer_params(model, active=active) - layer_params(model)
    return dense_total + n_moe * per_moe


def moe_flops_per_token(model: ModelSpec, seq_length: int) -> float:
    """Training FLOPs per token of an MoE model for MFU: as the dense formula
    (compute.model_flops_per_token) with each MoE layer's GEMM weights counted as the ones a
    token uses: router E h, shared experts and k of the E experts."""
    dense = model_flops_per_token(dataclasses.replace(model, moe=None), seq_length)
    moe = model.moe
    assert moe is not None
    f = moe.expert_ffn_hidden_size(model)
    active = (router_params(model) + shared_expert_params(model)
              + moe.router_topk * model.hidden_size * f * (_u(model) + 1))
    return dense + _num_moe_layers(model) * 6.0 * (active - dense_mlp_params(model))


# ---- transformer layer ----------------------------------------------------------------------


@overload
def gemm_efficiency(profile: ComputeProfile, smallest_dim: float) -> float: ...


@overload
def gemm_efficiency(profile: ComputeProfile, smallest_dim: np.ndarray) -> np.ndarray: ...


def gemm_efficiency(profile: ComputeProfile, smallest_dim: ArrayLike) -> ArrayLike:
    return profile.gemm_efficiency * smallest_dim / (smallest_dim + profile.gemm_half_dim)


def layer_gemm_forward_flops(model: ModelSpec, tokens: ArrayLike, tp: ArrayLike) -> ArrayLike:
    """2 * m * (layer GEMM weights) / t on one GPU."""
    return 2.0 * tokens * layer_matmul_params(model) / tp


def attention_forward_flops(
    model: ModelSpec, b: ArrayLike, seq_length: int, shards: ArrayLike, flash: bool = True
) -> ArrayLike:
    """Causal QK^T and AV: 2 * b * s^2 * q per replica with flash attention (half of
    4 b s^2 q: it skips masked blocks), the full 4 b s^2 q without it (batched GEMMs over the
    whole score matrix), split over `shards` = tp * cp * ulysses GPUs."""
    return (2.0 if flash else 4.0) * b * seq_length**2 * attention_dim(model) / shards


SCORE_BYTES_FORWARD = 12.0
"""Unfused attention, HBM bytes per score element forward (half precision): the QK^T GEMM
writes the scores (2), the fused scale-mask-softmax reads and writes them (4), dropout reads the
probabilities and writes them and a 1-byte mask (5), the AV GEMM reads them (2); rounded down."""
SCORE_BYTES_BACKWARD = 20.0
"""Unfused attention backward per score element: grad of the probabilities written and read
through dropout (5) and softmax (6, it also reads the probabilities), read twice by the QK^T
backward (4), the AV backward re-reads the probabilities (2); rounded up for the mask."""


TORCH_SOFTMAX_BYTES_FORWARD = 33.0
"""Extra HBM bytes per score element forward when Megatron's fused scale-mask-softmax kernel
cannot take the shape and FusedScaleMaskSoftmax.forward_torch_softmax runs instead (half inputs,
softmax in fp32): cast to fp32 (2 + 4), scale (4 + 4), masked fill (4 + 4 + 1 for the mask),
softmax (4 + 4), cast back (4 + 2) = 37, less the fused kernel's 4."""
TORCH_SOFTMAX_BYTES_BACKWARD = 35.0
"""The same backward: autograd through the five ops (6 + 12 + 9 + 8 + 6 = 41) less the fused
backward's 6."""
TORCH_SOFTMAX_EXTRA_KERNELS = 4
"""The torch fallback launches five kernels where the fused softmax launches one."""


def fused_softmax_available(
    model: ModelSpec, *, b: ArrayLike, seq_length: int, heads_shards: ArrayLike,
    element_bytes: int,
) -> np.ndarray:
    """Whether Megatron's fused causal scale-mask-softmax kernel takes the [b, a/shards, s, s]
    scores (FusedScaleMaskSoftmax.is_kernel_available, Megatron-Core 0.16.1): half-precision
    input, 16 < s <= 4096, s divisible by 4, and b * a / shards divisible by the kernel's batches
    per block (4 for s > 128, 8 below). `heads_shards` = tp * ulysses (heads per rank); micro-
    batches of one sample under TP 8 with 16 heads (2 per rank) fall back to torch softmax."""
    attn_batches = np.asarray(b * model.num_attention_heads / heads_shards, dtype=float)
    per_block = 4 if seq_length > 128 else 8
    shape_ok = element_bytes == 2 and 16 < seq_length <= 4096 and seq_length % 4 == 0
    whole = np.isclose(attn_batches, np.round(attn_batches))
    return shape_ok & whole & (np.round(attn_batches) % per_block == 0)


def attention_score_bytes(
    model: ModelSpec, b: ArrayLike, seq_length: int, shards: ArrayLike, flash: bool,
    fused_softmax: ArrayLike = True,
) -> tuple[ArrayLike, ArrayLike]:
    """(forward, backward) HBM bytes of the [b, a, s, s] score matrix on one GPU: zero with flash
    attention (scores stay in SRAM); otherwise SCORE_BYTES_* per element of its 1/shards part,
    plus TORCH_SOFTMAX_BYTES_* where the fused softmax cannot take the shape."""
    if flash:
        return 0.0, 0.0
    elements = b * model.num_attention_heads * seq_length**2 / shards
    torch_softmax = np.where(fused_softmax, 0.0, 1.0)
    return ((SCORE_BYTES_FORWARD + torch_softmax * TORCH_SOFTMAX_BYTES_FORWARD) * elements,
            (SCORE_BYTES_BACKWARD + torch_softmax * TORCH_SOFTMAX_BYTES_BACKWARD) * elements)


def layer_elementwise_bytes(
    model: ModelSpec, tokens: ArrayLike, tp: ArrayLike, sp: ArrayLike, element_bytes: int
) -> ArrayLike:
    """HBM traffic of one forward: ~15 passes over [m, h] (2 norms, 2 residual adds, 2 dropouts;
    split over t only under sequence parallelism), the activation function over [m, f/t]
    (3 passes for swiglu, 2 for gelu), rotary embedding over q and k ([m, (q+kv)/t], 2 passes)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    hidden = 15.0 * tokens * h / np.where(sp, tp, 1)
    act = (3.0 if model.activation == "swiglu" else 2.0) * tokens * f / tp
    rope = (
        2.0 * tokens * (q_dim(model) + kv_dim(model)) / tp
        if model.position_embedding == "rope"
        else 0.0
    )
    if model.mla is not None:  # MLA applies its own RoPE to the d_rope channels only
        rope = mla.rope_elements(model, tokens, tp)
    return element_bytes * (hidden + act + rope)


def layer_gemms(model: ModelSpec, tp: ArrayLike) -> list[tuple[ArrayLike, ArrayLike]]:
    """(k, n) of the layer's four weight GEMMs on one GPU ([tokens, k] x [k, n]): QKV and MLP-in
    are column-parallel (n / t), the output projection and MLP-out row-parallel (k / t)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    f_in = f * (2 if model.activation == "swiglu" else 1)
    if model.mla is not None:
        return mla.gemms(model, tp) + [(h, f_in / tp), (f / tp, h)]
    return [
        (h, (q_dim(model) + 2 * kv_dim(model)) / tp),
        (q_dim(model) / tp, h),
        (h, f_in / tp),
        (f / tp, h),
    ]


def layer_gemm_forward_s(
    model: ModelSpec, profile: ComputeProfile, *, tokens: ArrayLike, tp: ArrayLike, peak: float
) -> ArrayLike:
    """Forward seconds of the four weight GEMMs, each at the efficiency of its own smallest
    dimension (a TP shard narrows one dimension per GEMM, not all of them); the FLOPs add up to
    layer_gemm_forward_flops."""
    total: ArrayLike = 0.0
    for k, n in layer_gemms(model, tp):
        smallest = np.minimum(np.minimum(tokens, k), n)
        total = total + 2.0 * tokens * k * n / (peak * gemm_efficiency(profile, smallest))
    return total


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCompute:
    """Compute-only seconds of one layer for one micro-batch on one GPU (vectorised)."""

    forward_s: ArrayLike
    """GEMMs + attention + elementwise, forward."""
    backward_s: ArrayLike
    """The same, backward (without recomputation)."""
    attention_forward_s: ArrayLike
    """Core attention forward alone: selective recomputation repeats it; CP overlaps with it."""


def layer_compute(
    model: ModelSpec,
    cluster: ClusterSpec,
    profile: ComputeProfile,
    *,
    b: ArrayLike,
    seq_length: int,
    tp: ArrayLike,
    sp: ArrayLike,
    seq_shards: ArrayLike,
    element_bytes: int,
    flash_attention: bool = True,
    fused_softmax: ArrayLike = True,
) -> LayerCompute:
    """Per-GPU compute time of one transformer layer; `seq_shards` = cp * ulysses. Without
    flash attention the score matrix is computed in full and goes through HBM
    (attention_score_bytes; `fused_softmax` from fused_softmax_available)."""
    peak = cluster.peak_flops * (1.0 if element_bytes == 2 else profile.fp32_flops_ratio)
    tokens = b * seq_length / seq_shards
    gemm_s = layer_gemm_forward_s(model, profile, tokens=tokens, tp=tp, peak=peak)
    attn_flops = attention_forward_flops(model, b, seq_length, tp * seq_shards, flash_attention)
    score_f, score_b = attention_score_bytes(
        model, b, seq_length, tp * seq_shards, flash_attention, fused_softmax
    )
    hbm = profile.hbm_for(cluster)
    if flash_attention:  # the fused kernel recomputes the scores in backward
        attn_s = attn_flops / (peak * profile.attention_efficiency)
        attn_bwd_s = 2.5 * attn_flops / (peak * profile.attention_backward_efficiency)
    else:  # batched GEMMs (backward: 2x forward FLOPs) plus the score traffic
        attn_s = attn_flops / (peak * profile.attention_efficiency) + score_f / hbm
        attn_bwd_s = 2.0 * attn_flops / (peak * profile.attention_efficiency) + score_b / hbm
    elem_bytes = layer_elementwise_bytes(model, tokens, tp, sp, element_bytes)
    if profile.layer_extra_elementwise_passes > 0:
        elem_bytes = elem_bytes + (profile.layer_extra_elementwise_passes * element_bytes
                                   * tokens * model.hidden_size / tp)
    elem_s = elem_bytes / hbm
    return LayerCompute(
        forward_s=gemm_s + attn_s + elem_s,
        backward_s=2.0 * gemm_s + attn_bwd_s + 2.0 * elem_s,
        attention_forward_s=attn_s,
    )


# ---- host-side floor of a layer pass ---------------------------------------------------------


def layer_forward_kernels(
    model: ModelSpec, *, flash_attention: bool, dropout: bool, fused_softmax: ArrayLike = True
) -> ArrayLike:
    """Kernels one GPU launches in a transformer layer's forward, collectives not counted, with
    Megatron's fused ops (fused layer norm, bias-GeLU / SwiGLU, bias-dropout-add, scale-mask-
    softmax): 2 norms, 4 weight GEMMs (QKV, projection, MLP in and out; biases ride in the
    GEMM), 2 bias-dropout-residual adds, 1 activation, core attention (flash: 1 kernel; unfused:
    QK^T batched GEMM, softmax, dropout, AV batched GEMM and 2 layout copies), rotary embedding
    of q and k (2), q/k norms (2); TORCH_SOFTMAX_EXTRA_KERNELS more where the fused softmax
    cannot take the shape."""
    attention = core_attention_kernels(flash_attention=flash_attention, dropout=dropout,
                                       fused_softmax=fused_softmax)
    rope = 2 if model.position_embedding == "rope" else 0
    qk_norm = 2 if model.qk_layernorm else 0
    return 2 + 4 + 2 + 1 + attention + rope + qk_norm


def core_attention_kernels(
    *, flash_attention: bool, dropout: bool, fused_softmax: ArrayLike = True
) -> ArrayLike:
    """Kernels of core attention alone (what selective recomputation replays)."""
    if flash_attention:
        return 1
    return 5 + (1 if dropout else 0) + np.where(fused_softmax, 0, TORCH_SOFTMAX_EXTRA_KERNELS)


BACKWARD_KERNELS_PER_FORWARD = 2
"""A backward pass launches about two kernels per forward kernel (input gradient and weight /
bias gradient of each GEMM; the backward of each fused elementwise op and norm)."""


def layer_host_s(
    model: ModelSpec, host: HostConstants, *, tp: ArrayLike, flash_attention: bool,
    dropout: bool, fused_softmax: ArrayLike = True, forward_kernels: float = 0.0,
    backward_kernels: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, ArrayLike]:
    """(forward, backward, core-attention forward) host seconds of one layer pass on one GPU:
    kernels x host.kernel_s, plus per tensor-parallel collective one more kernel and
    host.collective_step_s per ring step (two blocks per pass, each an all-reduce or, under
    sequence parallelism, an all-gather plus a reduce-scatter: 2 (t - 1) steps per block).
    `forward_kernels` / `backward_kernels` (ComputeProfile's, > 0) replace the counts of
    Megatron-Core's fused layer."""
    kernels = forward_kernels if forward_kernels > 0 else layer_forward_kernels(
        model, flash_attention=flash_attention, dropout=dropout, fused_softmax=fused_softmax)
    backward = (backward_kernels if backward_kernels > 0
                else BACKWARD_KERNELS_PER_FORWARD * kernels)
    tp = np.asarray(tp, dtype=float)
    steps = 2 * 2.0 * (tp - 1.0)  # two blocks, two phases of t-1 steps each
    collectives = np.where(tp > 1, 2.0, 0.0)
    coll = collectives * host.kernel_s + steps * host.collective_step_s
    fwd = kernels * host.kernel_s + coll
    bwd = backward * host.kernel_s + coll
    attn = core_attention_kernels(flash_attention=flash_attention, dropout=dropout,
                                  fused_softmax=fused_softmax)
    return fwd, bwd, attn * host.kernel_s


def host_bound_s(gpu_s: ArrayLike, host_s: ArrayLike, power: float) -> ArrayLike:
    """Time of a pass whose kernels take gpu_s on the GPU and host_s to issue: the soft maximum
    (gpu^k + host^k)^(1/k). Each kernel waits for the slower of its launch and its predecessor,
    so the pass is never faster than either sum and slower than their maximum when the two are
    close; host_s = 0 gives gpu_s exactly."""
    gpu = np.asarray(gpu_s, dtype=float)
    host = np.asarray(host_s, dtype=float)
    if not np.any(host > 0):
        return gpu_s
    big = np.maximum(np.maximum(gpu, host), 1e-30)
    return big * ((gpu / big) ** power + (host / big) ** power) ** (1.0 / power)


# ---- vocabulary layers ----------------------------------------------------------------------


def output_layer_compute_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    profile: ComputeProfile,
    *,
    tokens: float,
    vocab_shard: float,
    element_bytes: int,
) -> tuple[float, float]:
    """(forward, backward) seconds of the output GEMM plus softmax cross-entropy on a
    [tokens, vocab_shard] logits shard: GEMM 2 * tokens * h * V_shard FLOPs forward, 2x backward;
    cross-entropy ~24 bytes of fp32 traffic per logit forward, ~12 backward."""
    peak = cluster.peak_flops * (1.0 if element_bytes == 2 else profile.fp32_flops_ratio)
    smallest = min(tokens, vocab_shard, model.hidden_size)
    gemm_s = (
        2.0 * tokens * model.hidden_size * vocab_shard / (peak * gemm_efficiency(profile, smallest))
    )
    logits = tokens * vocab_shard
    hbm = profile.hbm_for(cluster)
    return gemm_s + 24.0 * logits / hbm, 2.0 * gemm_s + 12.0 * logits / hbm


def embedding_compute_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    profile: ComputeProfile,
    *,
    tokens: float,
    element_bytes: int,
) -> tuple[float, float]:
    """(forward, backward) of the embedding lookup: gather [tokens, h] rows; scatter-add their
    fp32 gradient. Memory-bound."""
    hbm = profile.hbm_for(cluster)
    rows = tokens * model.hidden_size
    return 2.0 * element_bytes * rows / hbm, (element_bytes + 8.0) * rows / hbm


def optimizer_step_s(
    num_params: ArrayLike, cluster: ClusterSpec, profile: ComputeProfile
) -> ArrayLike:
    """Adam on this GPU's shard: ~30 bytes of HBM traffic per parameter (read fp32 master, grad,
    two moments; write master, moments and the half-precision copy)."""
    return 30.0 * num_params / profile.hbm_for(cluster)
