"""Realistic sequence-length batches: inverse-CDF sampling from published quantile tables.

Between two tabulated quantiles (p_i, q_i) and (p_j, q_j) a uniform u is mapped to
exp(lerp(ln q_i, ln q_j)) (log-length interpolated linearly in probability). Below the lowest
published quantile (p10) the tail is extrapolated with the log-normal fit of ln(length), shifted
so it meets the table at p10, and clamped to >= 1 token. Tables: the quantile
tables below (FlexSP's Wikipedia length file; a WLB-LLM-like 128K-context set).

`github_like` is synthetic: the WLB-LLM-like body with probability 1 - TAIL_WEIGHT and a Pareto
tail (x_min 32K, shape TAIL_SHAPE) otherwise, tuned so about 16% of tokens come from sequences
over 128K and 10% over 256K before truncation (ByteScale's GitHub figures). Not measured data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import ndtri

from megatron_ext.errors import PlanError


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthDistribution:
    """A token-length distribution given by quantiles plus a log-normal lower tail."""

    name: str
    """Label used on the command line and in benchmark output."""
    probs: tuple[float, ...]
    """Ascending cumulative probabilities of the tabulated quantiles, ending at 1.0."""
    lengths: tuple[float, ...]
    """Token lengths at `probs`."""
    lognormal_mu: float
    """Mean of ln(length) (lower-tail extrapolation)."""
    lognormal_sigma: float
    """Standard deviation of ln(length)."""

    def quantile(self, u: np.ndarray) -> np.ndarray:
        """Inverse CDF: uniforms in [0, 1) -> float lengths >= 1."""
        probs, log_q = np.asarray(self.probs), np.log(np.asarray(self.lengths))
        out = np.exp(np.interp(u, probs, log_q))
        low = u < probs[0]
        if low.any():
            # log-normal lower tail, shifted in log space to meet the table at probs[0]
            shift = log_q[0] - (self.lognormal_mu + self.lognormal_sigma * ndtri(probs[0]))
            z = ndtri(np.clip(u[low], 1e-12, None))
            out[low] = np.exp(self.lognormal_mu + self.lognormal_sigma * z + shift)
        return np.maximum(out, 1.0)


# Above p99 the Wikipedia table is refined with the histogram's tail shares (same JSON notes):
# >=32K 0.1277%, >=64K 0.0277%, >=128K 0.0047%, >=256K 0.0007% of sequences. Interpolating from
# p99.9 straight to the 1.8M maximum would put ~70x too many sequences above 256K.
WIKIPEDIA = LengthDistribution(
    name="wikipedia",
    probs=(0.10, 0.50, 0.75, 0.90, 0.95, 0.99, 0.998723, 0.999, 0.999723, 0.999953, 0.999993,
           1.0),
    lengths=(87, 347, 862, 2112, 3720, 10919, 32768, 37353, 65536, 131072, 262144, 1823777),
    lognormal_mu=5.95, lognormal_sigma=1.26,
)
WLB_LLM_LIKE = LengthDistribution(
    name="wlb_llm_like",
    probs=(0.10, 0.50, 0.75, 0.90, 0.95, 0.99, 0.999, 1.0),
    lengths=(646, 3227, 4832, 5784, 6110, 26058, 119794, 124913),
    lognormal_mu=7.80, lognormal_sigma=1.06,
)
TAIL_WEIGHT = 0.04
"""github_like: probability that a sequence comes from the Pareto tail."""
TAIL_MIN_TOKENS = 32768
TAIL_SHAPE = 1.74
"""Pareto shape of the github_like tail: 2**(1 - shape) = 0.6 = (share > 256K) / (share > 128K),
ByteScale's GitHub ratio 9.8% / 16.2%."""

DISTRIBUTIONS = ("wikipedia", "wlb_llm_like", "github_like")


def sample_lengths(
    distribution: str,
    num_sequences: int,
    *,
    max_length: int,
    rng: np.random.Generator,
    min_length: int = 1,
) -> np.ndarray:
    """`num_sequences` lengths (int64, [num_sequences]) from `distribution`, each in
    [min_length, max_length]. Longer draws are discarded and redrawn, as FlexSP drops sequences
    above its context limit (truncating instead would pile mass at the limit)."""
    if distribution not in DISTRIBUTIONS:
        raise PlanError(
            f"--distribution={distribution!r} is unknown; use one of {', '.join(DISTRIBUTIONS)}"
        )
    if num_sequences < 1 or max_length < min_length:
        raise PlanError(
            f"num_sequences={num_sequences} must be >= 1 and max_length={max_length} >= "
            f"min_length={min_length}"
        )
    out = np.empty(0, dtype=np.int64)
    for _ in range(1000):
        draw = _draw(distribution, 2 * num_sequences, rng)
        draw = draw[(draw >= min_length) & (draw <= max_length)]
        out = np.concatenate([out, draw])[:num_sequences]
        if out.size == num_sequences:
            return out
    raise PlanError(
        f"max_length={max_length} keeps almost no {distribution} sequences; raise it"
    )


def _draw(distribution: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if distribution == "wikipedia":
        return np.rint(WIKIPEDIA.quantile(rng.random(n))).astype(np.int64)
    body = np.rint(WLB_LLM_LIKE.quantile(rng.random(n))).astype(np.int64)
    if distribution == "wlb_llm_like":
        return body
    tail = rng.random(n) < TAIL_WEIGHT
    pareto = TAIL_MIN_TOKENS * (1 - rng.random(int(tail.sum()))) ** (-1 / TAIL_SHAPE)
    body[tail] = np.minimum(pareto, 2**40).astype(np.int64)
    return body


def tail_stats(lengths: np.ndarray) -> dict[str, float]:
    """Token share above 32K and 128K and the share of sum(s^2) above 32K for one batch."""
    s = lengths.astype(np.float64)
    tokens, squares = s.sum(), (s * s).sum()
    return {
        "tokens": float(tokens),
        "max_length": float(s.max()),
        "token_share_over_32k": float(s[s > 32768].sum() / tokens),
        "token_share_over_128k": float(s[s > 131072].sum() / tokens),
        "sq_share_over_32k": float((s[s > 32768] ** 2).sum() / squares),
    }


def expected_token_share_over(distribution: str, threshold: int, *, samples: int = 200_000,
                              seed: int = 0) -> float:
    """Monte-Carlo token share of sequences longer than `threshold` (untruncated)."""
    s = _draw(distribution, samples, np.random.default_rng(seed)).astype(np.float64)
    return float(s[s > threshold].sum() / s.sum()) if math.isfinite(s.sum()) else float("nan")
