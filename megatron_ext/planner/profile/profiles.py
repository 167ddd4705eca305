"""Measured profiles the cost model reads: a cluster profile and a model profile (pure data).

ClusterProfile (`megatron-ext profile hardware`): seconds of each collective per group size and
rank placement at increasing message sizes, the slowdown of communication running beside
compute, and a ClusterSpec whose alpha-beta links and peak are fitted from those measurements.
Byte convention as in planner/cost/comm.py: all_reduce the buffer, all_gather the gathered
output, reduce_scatter the full input, all_to_all one rank's send buffer, p2p the message.
Between measured sizes time is interpolated log-log; outside, extrapolated alpha-beta.

ModelProfile (`megatron-ext profile model`): forward, backward and recompute seconds of one
transformer layer's TP shard (communication excluded: it comes from the cluster profile) at
several (tp, sp, micro-batch, sequence), the vocabulary layers and the optimizer step, each fitted
by non-negative least squares on physical features (FLOPs, elementwise volume, a constant per
call) so the cost model can interpolate and extrapolate. JSON: schema_version 1, unknown keys
rejected, one-line PlanErrors naming the field (schema.py readers).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from megatron_ext.errors import PlanError
from megatron_ext.planner.profile.fit import (
    LAYER_PHASES,
    VOCAB_PHASES,
    CurveFit,
    LinearFit,
    fit_curve,
    fit_linear,
    layer_features,
    optimizer_features,
    vocab_features,
)
from megatron_ext.planner.profile.samples import (
    LayerSample,
    OptimizerSample,
    VocabSample,
)
from megatron_ext.schema import (
    expect_list,
    expect_object,
    get_float,
    get_float_list,
    get_int,
    get_optional_float,
    get_str,
    load_json_file,
    reject_unknown,
)
from megatron_ext.specs import ClusterSpec, LinkSpec, ModelSpec

if TYPE_CHECKING:
    from megatron_ext.planner.cost.comm import GroupLayout

__all__ = [
    "ClusterProfile", "CollectiveCurve", "LayerSample", "ModelProfile", "OptimizerSample",
    "VocabSample", "fitted_link",
]

SCHEMA_VERSION = 1
_MIN_CURVE_S = 1e-7
"""Floor of a gloo collective's time on its straight line (one timer tick)."""
COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
Layout = Literal["intra", "inter"]
ArrayLike = float | np.ndarray


def _check_version(data: Any, what: str) -> None:
    version = get_int(data, "schema_version", "")
    if version != SCHEMA_VERSION:
        raise PlanError(f"{what} schema_version={version} is not supported; this megatron_ext "
                        f"reads {SCHEMA_VERSION} (re-run megatron-ext profile)")


def _check_kind(data: Any, kind: str) -> None:
    got = get_str(data, "kind", "")
    if got != kind:
        raise PlanError(f"kind={got!r} but a {kind} was expected; pass the right file")


# ---- cluster profile ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveCurve:
    """Measured seconds of one collective on one group placement at increasing sizes."""

    collective: str
    """One of COLLECTIVES."""
    group_size: int
    """Ranks in each measured group (2 for p2p)."""
    stride: int
    """Rank distance between consecutive members: 1 adjacent, world/group_size strided."""
    ranks_per_node: int
    """Members of one group inside one node; == group_size means the group stays in a node."""
    num_bytes: tuple[float, ...]
    """Message sizes, strictly increasing (byte convention in the module docstring)."""
    seconds: tuple[float, ...]
    """Measured time at each size (slowest rank of all concurrently running groups)."""
    fit: CurveFit = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = f"collectives[{self.collective}, group_size={self.group_size}]"
        if self.collective not in COLLECTIVES:
            raise PlanError(f"{where}.collective must be one of {', '.join(COLLECTIVES)}")
        if not 1 <= self.ranks_per_node <= self.group_size or self.stride < 1:
            raise PlanError(f"{where}: ranks_per_node={self.ranks_per_node} must be in "
                            f"[1, group_size] and stride={self.stride} >= 1")
        if len(self.num_bytes) < 2 or len(self.num_bytes) != len(self.seconds):
            raise PlanError(f"{where} needs >= 2 sizes and one time per size (got "
                            f"{len(self.num_bytes)} sizes, {len(self.seconds)} times)")
        if (any(b <= a for a, b in zip(self.num_bytes, self.num_bytes[1:]))
                or self.num_bytes[0] <= 0):
            raise PlanError(f"{where}.num_bytes must be positive and strictly increasing")
        if any(t <= 0 for t in self.seconds):
            raise PlanError(f"{where}.seconds must all be > 0; re-run the profiler")
        object.__setattr__(self, "fit", fit_curve(np.array(self.num_bytes), np.array(self.seconds)))

    @property
    def crosses_nodes(self) -> bool:
        return self.ranks_per_node < self.group_size

    def time_s(self, num_bytes: ArrayLike) -> ArrayLike:
        return self.fit.time_s(num_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"collective": self.collective, "group_size": self.group_size,
                "stride": self.stride, "ranks_per_node": self.ranks_per_node,
                "num_bytes": list(self.num_bytes), "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, data: Any, path: str) -> CollectiveCurve:
        data = expect_object(data, path)
        reject_unknown(data, {"collective", "group_size", "stride", "ranks_per_node",
                              "num_bytes", "seconds"}, path)
        return cls(collective=get_str(data, "collective", path, choices=COLLECTIVES),
                   group_size=get_int(data, "group_size", path, minimum=2),
                   stride=get_int(data, "stride", path, minimum=1),
                   ranks_per_node=get_int(data, "ranks_per_node", path, minimum=1),
                   num_bytes=get_float_list(data, "num_bytes", path),
                   seconds=get_float_list(data, "seconds", path))


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterProfile:
    """Measured collectives and overlap of one cluster; implements the planner's CommModel."""

    cluster: ClusterSpec
    """Topology (nodes x ranks per node), memory, measured peak, fitted alpha-beta links."""
    backend: str
    """torch.distributed backend measured (nccl, gloo)."""
    device: str
    """What ran the measurement, e.g. 'NVIDIA H100 80GB HBM3' or 'cpu (2 cores)'."""
    overlap_slowdown: float = 1.0
    """How much longer communication and compute take side by side than the longer alone (>= 1)."""
    compute_slots_per_node: float | None = None
    """Ranks of one node that compute at full speed at once: gpus_per_node with a device per
    rank, fewer when ranks share CPU cores (None: not measured, a device per rank)."""
    compute_burst_s: float = 0.0
    """Seconds of compute every rank ran right before each timed collective (subtracted from the
    times). 0: collectives timed alone, as the profiler does now; > 0 only in profiles of older
    versions, which timed them after a burst on shared CPU cores and so priced the waits of
    ranks the scheduler left behind as communication (the shared-compute model counts them as
    compute already); re-profile to drop that double count."""
    comm_cpu_share: float = 0.0
    """Share of a node's compute slots its ranks' collectives keep busy while they run (CPU
    ranks: the transfer is CPU work; 0 on GPUs and in profiles that predate it)."""
    collectives: tuple[CollectiveCurve, ...] = ()
    """Measured curves."""
    _index: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.overlap_slowdown >= 1.0:
            raise PlanError(f"overlap_slowdown={self.overlap_slowdown} must be >= 1 (1 = "
                            "perfect overlap)")
        if not self.compute_burst_s >= 0:
            raise PlanError(f"compute_burst_s={self.compute_burst_s} must be >= 0")
        if not 0.0 <= self.comm_cpu_share <= 1.0:
            raise PlanError(f"comm_cpu_share={self.comm_cpu_share} must be in [0, 1]; re-run "
                            "the profiler")
        slots = self.compute_slots_per_node
        if slots is not None and not 1.0 <= slots <= self.cluster.gpus_per_node:
            raise PlanError(f"compute_slots_per_node={slots} must be in [1, gpus_per_node="
                            f"{self.cluster.gpus_per_node}]")
        index = {}
        for curve in sorted(self.collectives, key=lambda c: -c.stride):  # adjacent wins ties
            index[(curve.collective, curve.group_size, curve.ranks_per_node)] = curve
        object.__setattr__(self, "_index", index)

    def curve(self, collective: str, group_size: int, ranks_per_node: int
              ) -> CollectiveCurve | None:
        return self._index.get((collective, group_size, ranks_per_node))

    def collective_time_s(self, collective: str, group_size: int, layout: Layout | int,
                          num_bytes: ArrayLike) -> ArrayLike:
        """Seconds of `collective` over `group_size` ranks placed `layout`: 'intra' (inside a
        node), 'inter' (spread over nodes as far as possible) or an explicit ranks-per-node."""
        if group_size == 1 and collective != "p2p":
            return np.asarray(num_bytes, dtype=float) * 0.0
        if isinstance(layout, int):
            q = layout
        elif layout == "intra":
            q = group_size
        elif layout == "inter":
            q = max(1, group_size // self.cluster.num_nodes)
        else:
            raise ValueError(f"layout={layout!r} must be 'intra', 'inter' or ranks per node")
        curve = self.curve(collective, group_size, q)
        if curve is not None and self.backend == "gloo":
            # a fixed cost per call plus bytes over one bandwidth (TCP, no protocol switches);
            # the scheduler scatters single points by up to 2x from one profile to the next
            return np.maximum(curve.fit.line_time_s(num_bytes), _MIN_CURVE_S)
        if curve is not None:
            return curve.time_s(num_bytes)
        return self._alpha_beta_s(collective, group_size, q, num_bytes)

    def time_s(self, collective: str, num_bytes: ArrayLike, layout: GroupLayout) -> ArrayLike:
        """The planner's CommModel protocol (`layout` has .size and .ranks_per_node); broadcast is
        timed as an all_gather of the same volume (one ring pass)."""
        op = "all_gather" if collective == "broadcast" else collective
        size = 2 if collective == "p2p" else layout.size
        return self.collective_time_s(op, size, int(layout.ranks_per_node), num_bytes)

    def _alpha_beta_s(self, collective: str, p: int, q: int, num_bytes: ArrayLike) -> ArrayLike:
        """Unmeasured placement: ring formula on the fitted intra- or inter-node link."""
        link = self.cluster.inter_node if q < p else self.cluster.intra_node
        n = np.asarray(num_bytes, dtype=float)
        steps = {"all_reduce": 2 * (p - 1), "p2p": 1}.get(collective, p - 1)
        volume = {"all_reduce": 2 * (p - 1) / p, "p2p": 1.0}.get(collective, (p - 1) / p)
        out = steps * link.latency_s + volume * n / link.bandwidth_bytes_per_s
        return float(out) if out.ndim == 0 else out

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "kind": "cluster_profile",
                "backend": self.backend, "device": self.device,
                "overlap_slowdown": self.overlap_slowdown,
                "compute_slots_per_node": self.compute_slots_per_node,
                "compute_burst_s": self.compute_burst_s,
                "comm_cpu_share": self.comm_cpu_share,
                "cluster": self.cluster.to_dict(),
                "collectives": [c.to_dict() for c in self.collectives]}

    @classmethod
    def from_dict(cls, data: Any) -> ClusterProfile:
        data = expect_object(data, "cluster profile")
        reject_unknown(data, {"schema_version", "kind", "backend", "device", "overlap_slowdown",
                              "compute_slots_per_node", "compute_burst_s", "comm_cpu_share",
                              "cluster", "collectives"}, "")
        _check_version(data, "cluster profile")
        _check_kind(data, "cluster_profile")
        items = expect_list(data.get("collectives", []), "collectives")
        return cls(
            cluster=ClusterSpec.from_dict(data.get("cluster"), "cluster"),
            backend=get_str(data, "backend", ""), device=get_str(data, "device", ""),
            overlap_slowdown=get_float(data, "overlap_slowdown", "", default=1.0),
            compute_slots_per_node=get_optional_float(data, "compute_slots_per_node", "",
                                                      positive=True),
            compute_burst_s=get_float(data, "compute_burst_s", "", default=0.0),
            comm_cpu_share=get_float(data, "comm_cpu_share", "", default=0.0),
            collectives=tuple(CollectiveCurve.from_dict(c, f"collectives[{i}]")
                              for i, c in enumerate(items)),
        )

    @classmethod
    def load(cls, path: str | Path) -> ClusterProfile:
        return cls.from_dict(load_json_file(path, "cluster profile"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def fitted_link(curves: list[CollectiveCurve]) -> LinkSpec | None:
    """Alpha-beta link from all-reduce curves: latency per ring step and bus bandwidth
    (2 (p-1)/p N / busbw), median over the curves given."""
    lat, bw = [], []
    for c in curves:
        p = c.group_size
        lat.append(c.fit.alpha_s / (2 * (p - 1)))
        bw.append(2 * (p - 1) / p * c.fit.bytes_per_s)
    if not bw:
        return None
    return LinkSpec(bandwidth_bytes_per_s=float(np.median(bw)), latency_s=float(np.median(lat)))


# ---- model profile --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """Measured layer, vocabulary and optimizer costs of one model on one device type."""

    model: ModelSpec
    """The model measured."""
    precision: str
    """bf16, fp16 or fp32."""
    device: str
    """What ran the measurement."""
    concurrency: int = 1
    """Ranks that will share one device (ranks per CPU node; 1 on GPUs). Layer, vocabulary and
    optimizer times are of one rank alone."""
    sharing_slowdown: float = 1.0
    """How much slower each rank computes when `concurrency` ranks compute at once (measured with
    a stack of the model's layers run back to back); 1 with a device per rank."""
    sharing_alone_s: float | None = None
    """Fastest step of that layer stack run by one process alone, timed in the same rounds as
    the layer samples (and kept by the same fastest-run rule): the reference a later probe of
    the same stack compares the machine's solo speed with (planner/profile/load.py); None: not
    recorded (older profiles)."""
    layers: tuple[LayerSample, ...]
    """Transformer layer shapes measured; at least one."""
    vocab: tuple[VocabSample, ...] = ()
    """Vocabulary layer shapes measured (empty: the cost model's formulas)."""
    optimizer: tuple[OptimizerSample, ...] = ()
    """Optimizer step sizes measured (empty: the cost model's formula)."""
    fits: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise PlanError(f"precision={self.precision!r} must be bf16, fp16 or fp32")
        if self.concurrency < 1:
            raise PlanError(f"concurrency={self.concurrency} must be >= 1")
        if not self.sharing_slowdown >= 1.0:
            raise PlanError(f"sharing_slowdown={self.sharing_slowdown} must be >= 1")
        if self.sharing_alone_s is not None and not self.sharing_alone_s > 0:
            raise PlanError(f"sharing_alone_s={self.sharing_alone_s} must be > 0 (or absent)")
        if not self.layers:
            raise PlanError("layers is empty; a model profile needs at least one layer sample")
        for i, s in enumerate(self.layers):
            if s.sp and s.tp == 1:
                raise PlanError(f"layers[{i}].sp=true needs tp > 1")
            if self.model.num_attention_heads % s.tp:
                raise PlanError(f"layers[{i}].tp={s.tp} does not divide the model's "
                                f"{self.model.num_attention_heads} heads")
        fits: dict[str, LinearFit] = {}
        x = layer_features(self.model, tp=np.array([s.tp for s in self.layers]),
                           sp=np.array([s.sp for s in self.layers]),
                           micro_batch_size=np.array([s.micro_batch_size for s in self.layers]),
                           seq_length=np.array([s.seq_length for s in self.layers]))
        for phase in LAYER_PHASES:
            fits[phase] = fit_linear(x, np.array([getattr(s, phase) for s in self.layers]))
        mem = [s.activation_bytes for s in self.layers]
        if all(m is not None for m in mem):
            fits["activation_bytes"] = fit_linear(x, np.array(mem, dtype=float))
        if self.vocab:
            xv = vocab_features(self.model, tp=np.array([s.tp for s in self.vocab]),
                                tokens=np.array([s.tokens for s in self.vocab]))
            for phase in VOCAB_PHASES:
                fits[phase] = fit_linear(xv, np.array([getattr(s, phase) for s in self.vocab]))
        if self.optimizer:
            xo = optimizer_features(np.array([s.num_params for s in self.optimizer]))
            fits["optimizer_step_s"] = fit_linear(
                xo, np.array([s.step_s for s in self.optimizer]))
        object.__setattr__(self, "fits", fits)

    def layer_time_s(self, phase: str, *, tp: ArrayLike, sp: ArrayLike,
                     micro_batch_size: ArrayLike, seq_length: ArrayLike,
                     seq_shards: ArrayLike = 1) -> ArrayLike:
        """Fitted seconds of `phase` (forward_s, backward_s, recompute_s, selective_recompute_s)
        of one layer shard; vectorised. `seq_shards` = cp * ulysses splits the tokens."""
        if phase not in LAYER_PHASES:
            raise ValueError(f"phase={phase!r} must be one of {LAYER_PHASES}")
        x = layer_features(self.model, tp=tp, sp=sp, micro_batch_size=micro_batch_size,
                           seq_length=seq_length, seq_shards=seq_shards)
        return self.fits[phase].predict(x)

    def activation_bytes(self, *, tp: ArrayLike, sp: ArrayLike, micro_batch_size: ArrayLike,
                         seq_length: ArrayLike) -> ArrayLike | None:
        """Fitted kept-activation bytes, or None when not measured (CPU)."""
        fit = self.fits.get("activation_bytes")
        if fit is None:
            return None
        return fit.predict(layer_features(self.model, tp=tp, sp=sp,
                                          micro_batch_size=micro_batch_size,
                                          seq_length=seq_length))

    def vocab_time_s(self, phase: str, *, tp: ArrayLike, tokens: ArrayLike) -> ArrayLike | None:
        """Fitted seconds of a vocabulary phase (VOCAB_PHASES), or None when not measured."""
        if phase not in VOCAB_PHASES:
            raise ValueError(f"phase={phase!r} must be one of {VOCAB_PHASES}")
        fit = self.fits.get(phase)
        return None if fit is None else fit.predict(vocab_features(self.model, tp=tp,
                                                                   tokens=tokens))

    def optimizer_step_s(self, num_params: ArrayLike) -> ArrayLike | None:
        fit = self.fits.get("optimizer_step_s")
        return None if fit is None else fit.predict(optimizer_features(num_params))

    def fit_report(self) -> dict[str, tuple[float, float]]:
        """(median, max) relative error of each fit on its own samples."""
        return {name: (f.median_rel_error, f.max_rel_error) for name, f in self.fits.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "kind": "model_profile",
                "model": self.model.to_dict(), "precision": self.precision,
                "device": self.device, "concurrency": self.concurrency,
                "sharing_slowdown": self.sharing_slowdown,
                "sharing_alone_s": self.sharing_alone_s,
                "layers": [s.to_dict() for s in self.layers],
                "vocab": [s.to_dict() for s in self.vocab],
                "optimizer": [dataclasses.asdict(s) for s in self.optimizer]}

    @classmethod
    def from_dict(cls, data: Any) -> ModelProfile:
        data = expect_object(data, "model profile")
        reject_unknown(data, {"schema_version", "kind", "model", "precision", "device",
                              "concurrency", "sharing_slowdown", "sharing_alone_s", "layers",
                              "vocab", "optimizer"},
                       "")
        _check_version(data, "model profile")
        _check_kind(data, "model_profile")

        def items(key: str, reader: Any) -> tuple:
            return tuple(reader(v, f"{key}[{i}]")
                         for i, v in enumerate(expect_list(data.get(key, []), key)))

        return cls(model=ModelSpec.from_dict(data.get("model"), "model"),
                   precision=get_str(data, "precision", "", choices=("bf16", "fp16", "fp32")),
                   device=get_str(data, "device", ""),
                   concurrency=get_int(data, "concurrency", "", default=1, minimum=1),
                   sharing_slowdown=get_float(data, "sharing_slowdown", "", default=1.0),
                   sharing_alone_s=get_optional_float(data, "sharing_alone_s", "",
                                                      positive=True),
                   layers=items("layers", LayerSample.from_dict),
                   vocab=items("vocab", VocabSample.from_dict),
                   optimizer=items("optimizer", OptimizerSample.from_dict))

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        return cls.from_dict(load_json_file(path, "model profile"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")
