"""Fits behind the profiles (pure numpy/scipy): collective curves and linear cost models.

Collective curves (CurveFit): times are first made non-decreasing from above (a smaller message
measured slower than a larger one was disturbed: it takes the larger one's time); between sizes,
log-log interpolation (piecewise power
law: latency-bound and bandwidth-bound regions both stay straight); below the smallest size,
alpha-beta down to the latency; above the largest, alpha-beta at the bandwidth of the largest
sizes.

Compute costs (LinearFit): t = sum_i c_i x_i with c_i >= 0 (scipy NNLS), each row weighted by
1/t so the fit minimises relative error; samples far above the fit (disturbed by other work)
are dropped from a second fit. Features of one transformer layer shard (legend:
b micro-batch, s sequence, k = cp * ulysses sequence shards, m = b s / k tokens, P = layer GEMM
weights, q = heads * head_dim, h hidden, t = tp):
  1                 launch and framework overhead per call
  2 m P / t         GEMM FLOPs
  2 b s^2 q / (t k) causal attention FLOPs (scores and softmax traffic scale the same way)
  m h / (t if sp)   elementwise traffic on [m, h]: norms, residuals, dropout
Vocabulary layers (n tokens, V_t = padded vocabulary / t): 1, n h V_t (output GEMM),
n V_t (cross-entropy), n h (embedding). Optimizer: 1, parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from megatron_ext.geometry.vocab_partition import padded_vocab_size
from megatron_ext.planner.cost.compute import layer_matmul_params, q_dim
from megatron_ext.specs import ModelSpec

ArrayLike = float | np.ndarray
LAYER_PHASES: tuple[str, ...] = ("forward_s", "backward_s", "recompute_s", "selective_recompute_s")
VOCAB_PHASES: tuple[str, ...] = (
    "embedding_forward_s", "embedding_backward_s", "output_forward_s", "output_backward_s",
)
OUTLIER_RATIO = 1.3
"""A sample this much slower than the first fit is taken as disturbed and left out."""
_TAIL_POINTS = 3
"""Largest sizes whose slope sets the extrapolated bandwidth."""


def _scalar(out: np.ndarray) -> ArrayLike:
    return float(out) if np.ndim(out) == 0 else out


@dataclass(frozen=True, kw_only=True, slots=True)
class CurveFit:
    """Monotone time-vs-bytes curve through measured points (see module docstring)."""

    log_bytes: np.ndarray  # [k]
    log_seconds: np.ndarray  # [k]
    alpha_s: float
    """Fitted latency: intercept of t = alpha + n / beta over all points (relative weights)."""
    bytes_per_s: float
    """Algorithmic bandwidth of the largest sizes (slope of their alpha-beta fit)."""
    line: tuple[float, float] = (0.0, 0.0)
    """(seconds, seconds per byte) of the least-squares straight line t = a + b n through every
    point (non-negative): `line_time_s`."""

    def line_time_s(self, num_bytes: ArrayLike) -> ArrayLike:
        """The straight line through all points: a collective with one fixed cost per call and
        one bandwidth, whose points scatter more than its curve bends (gloo on shared CPU
        cores, ClusterProfile.collective_time_s), priced from every size at once."""
        n = np.maximum(np.asarray(num_bytes, dtype=float), 1.0)
        return _scalar(self.line[0] + self.line[1] * n)

    def time_s(self, num_bytes: ArrayLike) -> ArrayLike:
        n = np.maximum(np.asarray(num_bytes, dtype=float), 1.0)
        x0, xk = np.exp(self.log_bytes[0]), np.exp(self.log_bytes[-1])
        t0, tk = np.exp(self.log_seconds[0]), np.exp(self.log_seconds[-1])
        inside = np.exp(np.interp(np.log(n), self.log_bytes, self.log_seconds))
        above = tk + (n - xk) / self.bytes_per_s
        below = np.maximum(t0 - (x0 - n) / self.bytes_per_s, min(self.alpha_s, t0))
        return _scalar(np.where(n > xk, above, np.where(n < x0, below, inside)))


def fit_curve(num_bytes: np.ndarray, seconds: np.ndarray) -> CurveFit:
    """CurveFit through (num_bytes, seconds); sizes strictly increasing, times positive."""
    # A smaller message never takes longer than a larger one, and noise from other work only adds
    # time: where a smaller size measured slower, the larger size's time bounds it.
    seconds = np.minimum.accumulate(seconds[::-1])[::-1]
    rows = np.stack([np.ones_like(num_bytes), num_bytes], axis=1) / seconds[:, None]
    (alpha, _), _ = nnls(rows, np.ones_like(seconds))
    tail = slice(max(0, len(seconds) - _TAIL_POINTS), None)
    slope = np.polyfit(num_bytes[tail], seconds[tail], 1)[0]
    if not slope > 0:  # flat tail (noise): fall back to the end-to-end slope
        slope = max((seconds[-1] - seconds[0]) / (num_bytes[-1] - num_bytes[0]), 1e-15)
    (a, b), _ = nnls(rows * seconds[:, None], seconds)
    return CurveFit(log_bytes=np.log(num_bytes), log_seconds=np.log(seconds),
                    alpha_s=float(alpha), bytes_per_s=float(1.0 / slope),
                    line=(float(a), float(b)))


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearFit:
    """t = features @ coef with non-negative coefficients (features scaled by `scale`)."""

    coef: np.ndarray  # [num_features], for scaled features
    scale: np.ndarray  # [num_features]
    median_rel_error: float
    """Median |fit - measured| / measured over the samples."""
    max_rel_error: float
    """Largest relative error over the samples."""

    def predict(self, features: np.ndarray) -> ArrayLike:
        return _scalar(np.maximum((features / self.scale) @ self.coef, 0.0))


def fit_linear(features: np.ndarray, target: np.ndarray) -> LinearFit:
    """NNLS of `target` [n] on `features` [n, k], relative-error weights. Noise from other work
    on the machine only adds time, so samples more than OUTLIER_RATIO above the first fit are
    left out of a second fit (if enough remain); the errors cover every sample."""
    scale = np.maximum(np.abs(features).max(axis=0), 1e-30)  # [k]
    x = features / scale
    floor = max(0.1 * float(np.median(np.abs(target))), 1e-12)
    weight = 1.0 / np.maximum(target, floor)  # [n]
    coef, _ = nnls(x * weight[:, None], target * weight)
    keep = target <= OUTLIER_RATIO * np.maximum(x @ coef, floor)  # [n]
    if keep.sum() >= min(len(target), 2 * x.shape[1]) and not keep.all():
        coef, _ = nnls((x * weight[:, None])[keep], (target * weight)[keep])
    rel = np.abs(x @ coef - target) / np.maximum(target, floor)
    return LinearFit(coef=coef, scale=scale, median_rel_error=float(np.median(rel)),
                     max_rel_error=float(rel.max()))


def layer_features(model: ModelSpec, *, tp: ArrayLike, sp: ArrayLike,
                   micro_batch_size: ArrayLike, seq_length: ArrayLike,
                   seq_shards: ArrayLike = 1) -> np.ndarray:  # [..., 4]
    tp = np.asarray(tp, dtype=float)
    b = np.asarray(micro_batch_size, dtype=float)
    s = np.asarray(seq_length, dtype=float)
    tokens = b * s / seq_shards
    gemm = 2.0 * tokens * layer_matmul_params(model) / tp
    attention = 2.0 * b * s * s * q_dim(model) / (tp * seq_shards)
    elementwise = tokens * model.hidden_size / np.where(np.asarray(sp, dtype=bool), tp, 1.0)
    return np.stack(np.broadcast_arrays(np.ones_like(gemm), gemm, attention, elementwise), -1)


def vocab_features(model: ModelSpec, *, tp: ArrayLike, tokens: ArrayLike) -> np.ndarray:  # [..., 4]
    tp_arr = np.asarray(tp, dtype=np.int64)
    vocab = np.vectorize(lambda t: padded_vocab_size(model.vocab_size, int(t)))(tp_arr)
    shard = vocab / tp_arr
    n = np.asarray(tokens, dtype=float)
    h = model.hidden_size
    return np.stack(np.broadcast_arrays(np.ones_like(n * shard), n * h * shard, n * shard,
                                        n * h * np.ones_like(shard)), -1).astype(float)


def optimizer_features(num_params: ArrayLike) -> np.ndarray:  # [..., 2]
    n = np.asarray(num_params, dtype=float)
    return np.stack([np.ones_like(n), n], -1)
