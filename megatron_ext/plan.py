"""The plan file: a versioned, validated description of one full parallel layout.

JSON (schema_version 1) stores per-layer strategies as half-open ranges
`{"start": 0, "end": 12, "tp": 2, ...}`; in memory `ParallelPlan.layers` holds one LayerStrategy
per transformer layer. Validation errors are one-line PlanErrors naming field, value and fix;
they are raised on construction, so a ParallelPlan that exists is consistent.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatron_ext.errors import PlanError
from megatron_ext.plan_checks import check_plan
from megatron_ext.schema import (
    expect_list,
    expect_object,
    get_bool,
    get_float,
    get_float_list,
    get_int,
    get_str,
    load_json_file,
    reject_unknown,
)
from megatron_ext.specs import ClusterSpec, FP8Spec, ModelSpec

SCHEMA_VERSION = 1
Recompute = Literal["none", "selective", "full"]
RECOMPUTE_CHOICES: tuple[str, ...] = ("none", "selective", "full")
ZERO_CHOICES: tuple[int, ...] = (0, 1, 2, 3)
Precision = Literal["bf16", "fp16", "fp32"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerStrategy:
    """Parallel layout of one transformer layer. Hashable: a DP-table key and a group-cache key."""

    tp: int = 1
    """Tensor-parallel degree; divides num_attention_heads and num_query_groups."""
    sp: bool = False
    """Megatron sequence parallelism inside the TP group: activations are [s/tp, b, h]."""
    cp: int = 1
    """Context-parallel degree (Megatron ring attention): the sequence is cut into 2*cp chunks."""
    ulysses: int = 1
    """Ulysses (DeepSpeed) sequence-parallel degree: all-to-all between sequence and heads."""
    dp: int = 1
    """Data-parallel degree: replicas of this layer, each on micro_batch_size/dp samples."""
    zero: int = 0
    """0 = DDP, 1 = distributed optimizer (optimizer states sharded over dp), 2 = gradients and
    optimizer states sharded (weights gathered once per micro-batch), 3 = fully sharded."""
    recompute: Recompute = "none"
    """Activation recomputation: none, selective (core attention) or full (the whole layer)."""
    ep: int = 1
    """MoE layers only: expert-parallel degree (--expert-model-parallel-size); the routed experts
    are split over ep ranks and tokens reach them by all-to-all."""
    etp: int | None = None
    """MoE layers only: expert tensor-parallel degree (--expert-tensor-parallel-size); None means
    tp, Megatron-LM's default. The experts' data-parallel degree follows:
    width / (ep * etp) (Megatron-Core's MoE parallel folding)."""

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "ulysses", "dp", "ep"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name}={getattr(self, name)} must be >= 1")
        if self.etp is not None and self.etp < 1:
            raise PlanError(f"etp={self.etp} must be >= 1 (or left out: etp = tp)")
        if self.sp and self.tp == 1:
            raise PlanError("sp=true needs tp > 1; set sp=false or raise tp")
        if self.zero not in ZERO_CHOICES:
            raise PlanError(f"zero={self.zero} must be 0 (DDP), 1 (distributed optimizer), "
                            "2 (sharded gradients) or 3 (fully sharded)")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise PlanError(f"recompute={self.recompute!r} must be none, selective or full")

    @property
    def width(self) -> int:
        """Ranks one replica-set of this layer spans: tp * cp * ulysses * dp."""
        return self.tp * self.cp * self.ulysses * self.dp

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel degree: etp, or tp when etp is not given."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert (MoE layers): width / (ep * expert_tp)."""
        return self.width // (self.ep * self.expert_tp)

    @property
    def has_expert_dims(self) -> bool:
        return self.ep != 1 or self.etp is not None

    def describe(self) -> str:
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else "")]
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"uly{self.ulysses}"] if self.ulysses > 1 else []
        parts += [f"dp{self.dp}" + (f"/z{self.zero}" if self.zero else "")]
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"etp{self.etp}"] if self.etp is not None else []
        parts += [] if self.recompute == "none" else [f"rc:{self.recompute}"]
        return " ".join(parts)


_STRATEGY_KEYS = frozenset({"tp", "sp", "cp", "ulysses", "dp", "zero", "recompute", "ep", "etp"})


def _strategy_from_dict(data: Any, path: str) -> LayerStrategy:
    data = expect_object(data, path)
    try:
        return LayerStrategy(
            tp=get_int(data, "tp", path, default=1),
            sp=get_bool(data, "sp", path, default=False),
            cp=get_int(data, "cp", path, default=1),
            ulysses=get_int(data, "ulysses", path, default=1),
            dp=get_int(data, "dp", path),
            zero=get_int(data, "zero", path, default=0),
            recompute=get_str(data, "recompute", path, default="none",
                              choices=RECOMPUTE_CHOICES),  # type: ignore[arg-type]
            ep=get_int(data, "ep", path, default=1),
            etp=get_int(data, "etp", path) if data.get("etp") is not None else None,
        )
    except PlanError as err:
        if str(err).startswith(path):
            raise
        raise PlanError(f"{path}: {err}") from None


def _strategy_to_dict(strategy: LayerStrategy) -> dict[str, Any]:
    out = {k: getattr(strategy, k) for k in ("tp", "sp", "cp", "ulysses", "dp", "zero",
                                             "recompute")}
    if strategy.ep != 1:  # the expert keys only where set: dense plans keep their JSON
        out["ep"] = strategy.ep
    if strategy.etp is not None:
        out["etp"] = strategy.etp
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class VocabStrategy:
    """Layout of the input embedding and the output layer with its softmax cross-entropy."""

    mode: Literal["tp", "vocab_parallel"] = "tp"
    """tp: embedding on the first stage, output layer on the last, each split over `tp` ranks.
    vocab_parallel: both split over all pipeline x tensor-parallel ranks (Yeung et al. 2025)."""
    tp: int = 1
    """Tensor-parallel degree of the vocabulary layers (mode tp); divides world_size / pp."""
    algorithm: Literal[1, 2] = 1
    """vocab_parallel only: the number of communication barriers. 1 = one barrier (activations
    for p+1 micro-batches), 2 = two barriers (p+2). Note the paper numbers them the other way
    round: its "Algorithm 1" (Vocab-1) is our 2, its "Algorithm 2" (Vocab-2) our 1."""

    def __post_init__(self) -> None:
        if self.mode not in ("tp", "vocab_parallel"):
            raise PlanError(f"vocab.mode={self.mode!r} must be tp or vocab_parallel")
        if self.tp < 1:
            raise PlanError(f"vocab.tp={self.tp} must be >= 1")
        if self.algorithm not in (1, 2):
            raise PlanError(f"vocab.algorithm={self.algorithm} must be 1 or 2")

    @classmethod
    def from_dict(cls, data: Any, path: str = "vocab") -> VocabStrategy:
        data = expect_object(data, path)
        reject_unknown(data, {"mode", "tp", "algorithm"}, path)
        return cls(
            mode=get_str(data, "mode", path, default="tp",
                         choices=("tp", "vocab_parallel")),  # type: ignore[arg-type]
            tp=get_int(data, "tp", path, default=1, minimum=1),
            algorithm=get_int(data, "algorithm", path, default=1),  # type: ignore[arg-type]
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class FlexSPConfig:
    """Flexible sequence parallelism: each step picks Ulysses groups of different sizes."""

    max_group_size: int = 8
    """Largest sequence-parallel group; a power of two dividing num_attention_heads."""
    min_group_size: int = 1
    """Smallest group; 1 lets short sequences run without any all-to-all."""

    def __post_init__(self) -> None:
        for name in ("max_group_size", "min_group_size"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise PlanError(f"flexsp.{name}={value} must be a power of two >= 1")
        if self.min_group_size > self.max_group_size:
            raise PlanError(
                f"flexsp.min_group_size={self.min_group_size} exceeds "
                f"max_group_size={self.max_group_size}"
            )

    @classmethod
    def from_dict(cls, data: Any, path: str = "flexsp") -> FlexSPConfig:
        data = expect_object(data, path)
        reject_unknown(data, {"max_group_size", "min_group_size"}, path)
        return cls(
            max_group_size=get_int(data, "max_group_size", path, default=8),
            min_group_size=get_int(data, "min_group_size", path, default=1),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """What the search predicted for this plan; training logs print it beside measured values."""

    iteration_time_s: float
    """Predicted time of one optimizer step."""
    tokens_per_s: float
    """global_batch_size * seq_length / iteration_time_s."""
    mfu: float = 0.0
    """Model FLOPs utilisation (6N + attention FLOPs, no recompute) against cluster peak."""
    stage_peak_memory_gib: tuple[float, ...] = ()
    """Predicted peak memory per pipeline stage, one entry per stage."""
    stage_time_s: tuple[float, ...] = ()
    """Predicted busy time per stage for one iteration."""
    iteration_time_interval_s: tuple[float, float] | None = None
    """90% interval [low, high] of the iteration time, from the cost model's errors on held-out
    published runs like this one (planner/cost/interval.py); absent in older plans."""
    runners_up: tuple[dict[str, Any], ...] = dataclasses.field(default=(), hash=False)
    """The next-best layouts the search scored (summary, iteration time and interval each), when
    their intervals overlap this plan's: within the model's error of it. Not hashed (dicts)."""

    def to_dict(self) -> dict[str, Any]:
        out = {k: (list(v) if isinstance(v, tuple) else v)
               for k, v in dataclasses.asdict(self).items()}
        if self.iteration_time_interval_s is None:
            del out["iteration_time_interval_s"]
        if not self.runners_up:
            del out["runners_up"]
        return out

    @classmethod
    def from_dict(cls, data: Any, path: str = "prediction") -> Prediction:
        data = expect_object(data, path)
        reject_unknown(data, set(cls.__dataclass_fields__), path)
        lists = {
            key: get_float_list(data, key, path)
            for key in ("stage_peak_memory_gib", "stage_time_s")
        }
        interval: tuple[float, float] | None = None
        if "iteration_time_interval_s" in data:
            values = get_float_list(data, "iteration_time_interval_s", path)
            if len(values) != 2 or not 0 < values[0] <= values[1]:
                raise PlanError(
                    f"{path}.iteration_time_interval_s={list(values)} must be [low, high] "
                    "seconds with 0 < low <= high; drop it or re-run search/evaluate"
                )
            interval = (values[0], values[1])
        runners_up = expect_list(data.get("runners_up", []), f"{path}.runners_up")
        return cls(
            iteration_time_s=get_float(data, "iteration_time_s", path, positive=True),
            tokens_per_s=get_float(data, "tokens_per_s", path, positive=True),
            mfu=get_float(data, "mfu", path, default=0.0),
            iteration_time_interval_s=interval,
            runners_up=tuple(dict(expect_object(r, f"{path}.runners_up[{i}]"))
                             for i, r in enumerate(runners_up)),
            **lists,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanLayout:
    """What the cost model scores of a plan: its pipeline, per-layer strategies, vocabulary
    layers and micro-batch (model, cluster and batch come with the cost model)."""

    pp: int
    """Pipeline stages."""
    stages: tuple[tuple[int, int], ...]
    """Half-open layer range per stage, or per model chunk when virtual_stages > 1 (as
    ParallelPlan.stages)."""
    layers: tuple[LayerStrategy, ...]
    """One strategy per layer."""
    vocab: VocabStrategy = VocabStrategy()
    """Vocabulary layers."""
    micro_batch_size: int
    """Samples per micro-batch over a stage's replicas."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank; stages then lists pp * virtual_stages chunk ranges."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple((int(a), int(b)) for a, b in self.stages))
        object.__setattr__(self, "layers", tuple(self.layers))


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelPlan:
    """A full parallel layout: pipeline stages, per-layer strategies, vocabulary layers, batch."""

    world_size: int
    """Total ranks (GPUs)."""
    pp: int
    """Pipeline-parallel degree; every layer's tp*cp*ulysses*dp equals world_size / pp."""
    stages: tuple[tuple[int, int], ...]
    """Half-open layer range [start, end) of each pipeline stage; uneven splits allowed. With
    virtual_stages v > 1 there are pp * v contiguous ranges in model order, one per model chunk:
    chunk c of pipeline rank r is stages[c * pp + r] (Megatron's interleaved assignment)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (Megatron's virtual pipeline size): v > 1 runs the
    interleaved 1F1B schedule, which shrinks the bubble v-fold for v times the point-to-point
    messages and more in-flight micro-batches."""
    layers: tuple[LayerStrategy, ...]
    """One strategy per transformer layer, indexed by global zero-based layer_idx."""
    model: ModelSpec
    """The model this plan was made for."""
    micro_batch_size: int
    """Samples per micro-batch summed over a stage's data-parallel replicas (Megatron's
    micro_batch_size x dp); each replica of a layer gets micro_batch_size / dp of them."""
    global_batch_size: int
    """Samples per optimizer step; a multiple of micro_batch_size."""
    seq_length: int
    """Tokens per sample."""
    vocab: VocabStrategy = VocabStrategy()
    """Embedding / output-layer layout."""
    precision: Precision = "bf16"
    """Training precision; fp32 is what parity tests use."""
    fp8: FP8Spec | None = None
    """FP8 training of the layers' GEMMs (Megatron-LM --fp8-format ...), per layer as
    FP8Spec.layer_in_fp8 says; None: none (files without the key)."""
    flexsp: FlexSPConfig | None = None
    """When set, sequence-parallel groups are chosen per step (FlexSP); needs pp=1,
    tp=cp=ulysses=1."""
    overlap_grad_reduce: bool = False
    """The run passes Megatron-LM's --overlap-grad-reduce: the data-parallel gradient reduction
    runs bucket by bucket during the last backward. False (Megatron-LM's default, and files
    without the key): after the last backward, on the critical path. `search` turns it on
    unless asked not to (--no-overlap)."""
    overlap_param_gather: bool = False
    """The run passes Megatron-LM's --overlap-param-gather: ZeRO-1's weight all-gather overlaps
    the next forward. Needs overlap_grad_reduce and a ZeRO-1 layer (Megatron-LM: a distributed
    optimizer)."""
    tp_comm_overlap: bool = False
    """The run passes Megatron-LM's --tp-comm-overlap: Transformer Engine's userbuffers split
    each sequence-parallel all-gather / reduce-scatter into chunks pipelined with the GEMM it
    feeds or follows. Needs tp > 1 with sp in every tensor-parallel layer (Megatron-LM:
    --sequence-parallel). The planner prices it (docs/cost-model.md); megatron_ext's training
    runtime refuses it (it needs Transformer Engine on CUDA)."""
    cluster: ClusterSpec | None = None
    """The cluster this plan was made for, when known."""
    prediction: Prediction | None = None
    """The search's prediction, when the plan came from `megatron-ext search`."""

    def __post_init__(self) -> None:
        check_plan(self)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    @property
    def layout(self) -> PlanLayout:
        """The part of the plan the cost model scores (planner/cost/evaluate.py)."""
        return PlanLayout(pp=self.pp, stages=self.stages, layers=self.layers, vocab=self.vocab,
                          micro_batch_size=self.micro_batch_size,
                          virtual_stages=self.virtual_stages)

    @property
    def stage_width(self) -> int:
        """Ranks per pipeline stage."""
        return self.world_size // self.pp

    def chunk_of_layer(self, layer_idx: int) -> int:
        """Index into `stages` of the model chunk holding the layer (the pipeline stage when
        virtual_stages is 1)."""
        for chunk, (start, end) in enumerate(self.stages):
            if start <= layer_idx < end:
                return chunk
        raise IndexError(f"layer {layer_idx} is outside the model")

    def stage_of_layer(self, layer_idx: int) -> int:
        """Pipeline rank (stage) that runs the layer: its chunk index modulo pp."""
        return self.chunk_of_layer(layer_idx) % self.pp

    def rank_chunks(self, stage: int) -> tuple[tuple[int, int], ...]:
        """Layer ranges of the model chunks pipeline rank `stage` holds, in chunk order."""
        return tuple(self.stages[c * self.pp + stage] for c in range(self.virtual_stages))

    def stage_layers(self, stage: int) -> tuple[int, ...]:
        """Global indices of every layer pipeline rank `stage` holds, over all its chunks."""
        return tuple(i for start, end in self.rank_chunks(stage) for i in range(start, end))

    def layer_runs(self) -> Iterator[tuple[int, int, LayerStrategy]]:
        """Maximal runs (start, end, strategy) of consecutive equal strategies, split at stages."""
        for start, end in self.stages:
            run_start = start
            for i in range(start + 1, end + 1):
                if i == end or self.layers[i] != self.layers[run_start]:
                    yield run_start, i, self.layers[run_start]
                    run_start = i

    def is_uniform(self) -> bool:
        """Same strategy in every layer: expressible with plain Megatron-LM flags."""
        return len(set(self.layers)) == 1

    # ---- JSON I/O -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "world_size": self.world_size,
            "pp": self.pp,
            **({"virtual_stages": self.virtual_stages} if self.virtual_stages > 1 else {}),
            "stages": [{"start": s, "end": e} for s, e in self.stages],
            "layers": [{"start": s, "end": e, **_strategy_to_dict(st)}
                       for s, e, st in self.layer_runs()],
            "vocab": dataclasses.asdict(self.vocab),
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
            "seq_length": self.seq_length,
            "precision": self.precision,
            **({"fp8": self.fp8.to_dict()} if self.fp8 is not None else {}),
            "flexsp": dataclasses.asdict(self.flexsp) if self.flexsp else None,
            **({"overlap_grad_reduce": True} if self.overlap_grad_reduce else {}),
            **({"overlap_param_gather": True} if self.overlap_param_gather else {}),
            **({"tp_comm_overlap": True} if self.tp_comm_overlap else {}),
            "model": self.model.to_dict(),
            "cluster": self.cluster.to_dict() if self.cluster else None,
            "prediction": self.prediction.to_dict() if self.prediction else None,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> ParallelPlan:
        return cls.from_dict(load_json_file(path, "plan file"))

    @classmethod
    def from_dict(cls, data: Any) -> ParallelPlan:
        data = expect_object(data, "plan")
        reject_unknown(data, _PLAN_KEYS, "")
        version = get_int(data, "schema_version", "")
        if version != SCHEMA_VERSION:
            raise PlanError(
                f"schema_version={version} is not supported; this megatron_ext reads "
                f"{SCHEMA_VERSION}"
            )
        model = ModelSpec.from_dict(data.get("model"), "model")
        optional: dict[str, Callable[[Any], Any]] = {
            "vocab": VocabStrategy.from_dict, "flexsp": FlexSPConfig.from_dict,
            "cluster": ClusterSpec.from_dict, "prediction": Prediction.from_dict,
            "fp8": FP8Spec.from_dict,
        }
        extra: dict[str, Any] = {k: fn(data[k]) for k, fn in optional.items()
                                 if data.get(k) is not None}
        return cls(
            world_size=get_int(data, "world_size", "", minimum=1),
            pp=get_int(data, "pp", "", minimum=1),
            stages=_stages_from_json(data.get("stages")),
            virtual_stages=get_int(data, "virtual_stages", "", default=1, minimum=1),
            layers=_layers_from_json(data.get("layers"), model.num_layers),
            model=model,
            micro_batch_size=get_int(data, "micro_batch_size", "", minimum=1),
            global_batch_size=get_int(data, "global_batch_size", "", minimum=1),
            seq_length=get_int(data, "seq_length", "", minimum=1),
            precision=get_str(data, "precision", "", default="bf16",
                              choices=("bf16", "fp16", "fp32")),  # type: ignore[arg-type]
            overlap_grad_reduce=get_bool(data, "overlap_grad_reduce", "", default=False),
            overlap_param_gather=get_bool(data, "overlap_param_gather", "", default=False),
            tp_comm_overlap=get_bool(data, "tp_comm_overlap", "", default=False),
            **extra,
        )


_PLAN_KEYS = frozenset({
    "schema_version", "world_size", "pp", "virtual_stages", "stages", "layers", "vocab",
    "micro_batch_size", "global_batch_size", "seq_length", "precision", "fp8", "flexsp",
    "overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "model", "cluster",
    "prediction",
})


def _range_from_json(item: Any, path: str) -> tuple[int, int]:
    item = expect_object(item, path)
    start = get_int(item, "start", path, minimum=0)
    end = get_int(item, "end", path, minimum=0)
    if end < start:
        raise PlanError(f"{path} has end={end} < start={start}; ranges are half-open [start, end)")
    return start, end


def _stages_from_json(value: Any) -> tuple[tuple[int, int], ...]:
    items = expect_list(value, "stages")
    stages = []
    for i, item in enumerate(items):
        stages.append(_range_from_json(item, f"stages[{i}]"))
        reject_unknown(item, {"start", "end"}, f"stages[{i}]")
    return tuple(stages)


def _layers_from_json(value: Any, num_layers: int) -> tuple[LayerStrategy, ...]:
    """Expand range entries into one strategy per layer; gaps and overlaps are errors."""
    items = expect_list(value, "layers")
    per_layer: list[LayerStrategy | None] = [None] * num_layers
    for i, item in enumerate(items):
        start, end = _range_from_json(item, f"layers[{i}]")
        reject_unknown(item, _STRATEGY_KEYS | {"start", "end"}, f"layers[{i}]")
        label = f"layers[{start}]" if end - start == 1 else f"layers[{start}:{end}]"
        strategy = _strategy_from_dict(item, label)
        if end > num_layers:
            raise PlanError(f"{label} ends past model.num_layers={num_layers}")
        for layer_idx in range(start, end):
            if per_layer[layer_idx] is not None:
                raise PlanError(
                    f"layer {layer_idx} is given twice in layers; ranges must not overlap")
            per_layer[layer_idx] = strategy
    missing = [i for i, s in enumerate(per_layer) if s is None]
    if missing:
        raise PlanError(
            f"layers gives no strategy for layer {missing[0]} ({len(missing)} layers missing); "
            f"cover [0, {num_layers}) with ranges"
        )
    return tuple(s for s in per_layer if s is not None)
