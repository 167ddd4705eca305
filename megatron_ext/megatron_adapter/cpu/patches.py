"""The thirteen named CPU patches for megatron-core 0.16.1-0.19.x and their registry (see
`cpu_compat`).

Each patch is a builder returning `(owner, attr, replacement)` targets; its docstring names the
megatron-core 0.16.1 `file:line` sites (paths relative to megatron/core/) it addresses, and 0.19
sites where they differ. Each patch states the megatron-core versions it applies to
(`CompatPatch.versions`, the table in patches/README.md); `cpu_compat.apply()` installs only those
for the megatron-core it runs with. This module only describes them and changes nothing on import.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ext.flags.versions import parse_version
from megatron_ext.megatron_adapter.cpu.torch_proxy import CpuTorchProxy

__all__ = [
    "ALL_VERSIONS",
    "CUDA_LITERAL_MODULES",
    "ORIGINAL",
    "PATCHES",
    "SENTINEL",
    "CompatPatch",
    "current_value",
    "in_range",
    "is_patched",
    "restore",
]

logger = logging.getLogger(__name__)

SENTINEL = "_megatron_ext_cpu_compat_patch"
"""Attribute stamped on every installed replacement: the name of its patch."""
ORIGINAL = "_megatron_ext_cpu_compat_original"
"""Attribute stamped on every installed replacement: the value it replaced."""
_RNG_LOGGER = "megatron.core.tensor_parallel.random"

Target = tuple[Any, str, Any]
"""(owner, attribute name, replacement)."""

CUDA_LITERAL_MODULES: tuple[str, ...] = (
    "megatron.core.pipeline_parallel.schedules",  # :596/983/2138 total_num_tokens
    "megatron.core.optimizer.optimizer",  # :473/481/485/907/1141 found_inf, _scale, ...
    "megatron.core.optimizer.clip_grads",  # :90/103/115/174/207 norm buffers
    "megatron.core.utils",  # :1207 local_multi_tensor_l2_norm
    "megatron.core.transformer.utils",  # :35/40 causal and sliding-window masks
    "megatron.core.optimizer.grad_scaler",  # :15/88/91/94/140 fp16 loss scale
    "megatron.core.tensor_parallel.data",  # :37 broadcast_data sizes
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # :204 cached-plan verify
    "megatron.core.dist_checkpointing.exchange_utils",  # :104/110/326 fully-parallel load
    "megatron.core.rerun_state_machine",  # :261/265 rerun / NaN check
)
"""Modules whose global `torch` the `cuda_literals` patch replaces with a `CpuTorchProxy`."""


ALL_VERSIONS = ">=0.16.1,<0.20"
"""Every supported megatron-core (compat_versions.SUPPORTED_RANGE)."""


def in_range(version: str, spec: str) -> bool:
    """`version` within `spec` (">=A,<B", the only form used here)."""
    low, high = (part.strip() for part in spec.split(","))
    assert low.startswith(">=") and high.startswith("<"), spec
    return parse_version(low[2:]) <= parse_version(version) < parse_version(high[1:])


@dataclass(frozen=True, kw_only=True, slots=True)
class CompatPatch:
    """One named patch in the registry."""

    name: str
    """Registry key, e.g. "current_device"."""
    build: Callable[[], list[Target]]
    """Returns the targets to install; side-effect free apart from imports."""
    on_apply: Callable[[], None] | None = None
    """Extra idempotent setup run after installing the targets."""
    on_undo: Callable[[], None] | None = None
    """Reverses `on_apply`."""
    versions: str = ALL_VERSIONS
    """The megatron-core versions the patch applies to, as a requirement range."""

    def applies_to(self, version: str) -> bool:
        """Whether megatron-core `version` needs this patch (`versions` contains it)."""
        return in_range(version, self.versions)

    @property
    def doc(self) -> str:
        """The builder's docstring: what is replaced, why, and the megatron-core sites."""
        return self.build.__doc__ or ""


PATCHES: dict[str, CompatPatch] = {}
"""Registry in application order. `cpu_compat.apply()` with no names applies all of them."""


def _register(
    name: str,
    on_apply: Callable[[], None] | None = None,
    on_undo: Callable[[], None] | None = None,
    versions: str = ALL_VERSIONS,
) -> Callable[[Callable[[], list[Target]]], Callable[[], list[Target]]]:
    def decorator(build: Callable[[], list[Target]]) -> Callable[[], list[Target]]:
        PATCHES[name] = CompatPatch(name=name, build=build, on_apply=on_apply, on_undo=on_undo,
                                    versions=versions)
        return build

    return decorator


class _Missing:
    """ORIGINAL of a replacement that added an attribute the owner did not have."""


MISSING = _Missing()


def current_value(owner: Any, attr: str) -> Any:
    """Attribute as stored (for classes: no descriptor binding, found along the MRO);
    `MISSING` when the owner has no such attribute."""
    if isinstance(owner, type):
        return inspect.getattr_static(owner, attr, MISSING)
    return getattr(owner, attr, MISSING)


def restore(owner: Any, attr: str, original: Any) -> None:
    """Put `original` back; for a class whose original was inherited, just drop the shadow; an
    attribute a patch added (`MISSING` original) is deleted."""
    if original is MISSING:
        if current_value(owner, attr) is not MISSING:
            delattr(owner, attr)
        return
    if isinstance(owner, type) and attr in owner.__dict__:
        delattr(owner, attr)
        if inspect.getattr_static(owner, attr, None) is original:
            return
    setattr(owner, attr, original)


def original_value(owner: Any, attr: str) -> Any:
    """The unpatched value of `owner.attr`, looking through one of our installed wrappers."""
    value = current_value(owner, attr)
    return getattr(value, ORIGINAL) if getattr(value, SENTINEL, None) else value


def is_patched(owner: Any, attr: str) -> bool:
    """True when `owner.attr` is a replacement installed by this module (any copy of it)."""
    return getattr(current_value(owner, attr), SENTINEL, None) is not None


# ---------------------------------------------------------------------------- the patches


@_register("current_device")
def _build_current_device() -> list[Target]:
    """`torch.cuda.current_device()` -> `torch.device("cpu")` (raises on CPU builds).

    mcore passes the value as `device=` at: utils.py:631 (GlobalMemoryBuffer, attention and SP
    buffers); tensor_parallel/layers.py:261/873/899/1197/1218 (GPU init) and :552/597/607, and
    mappings.py:91/141/148/181/442 (SP outputs); pipeline_parallel/p2p_communication.py:190-202,
    313, 321 (PP buffers); distributed/param_and_grad_buffer.py:783/800/806 (DDP buffers);
    optimizer/distrib_optimizer.py:791; state_dict_saver.py:252; timers.py:303.
    """

    def current_device() -> torch.device:
        return torch.device("cpu")

    return [(torch.cuda, "current_device", current_device)]


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)  # [sq, sq], True = masked


@_register("causal_mask")
def _build_causal_mask() -> list[Target]:
    """`get_default_causal_mask(sq)` -> cached CPU bool upper-triangular mask.

    transformer/utils.py:35 builds it with `device="cuda"`; fusions/fused_softmax.py:8 imports it
    by name (used at :327), so both module attributes are replaced. The sliding-window mask
    (transformer/utils.py:40) is covered by `cuda_literals` on transformer.utils instead.
    """
    import megatron.core.transformer.utils as transformer_utils
    from megatron.core.fusions import fused_softmax

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return _cpu_causal_mask(sq)

    return [
        (transformer_utils, "get_default_causal_mask", get_default_causal_mask),
        (fused_softmax, "get_default_causal_mask", get_default_causal_mask),
    ]


class _DropRngStateWarning(logging.Filter):
    """Drops "CPU RNG state changed within GPU RNG context" (random.py:264-265): with `rng`
    the CPU generator *is* the tracked generator, so every `tracker.fork()` would log it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed" not in record.getMessage()


def _rng_on_apply() -> None:
    rng_logger = logging.getLogger(_RNG_LOGGER)
    if not any(getattr(f, SENTINEL, None) for f in rng_logger.filters):
        drop = _DropRngStateWarning()
        setattr(drop, SENTINEL, "rng")
        rng_logger.addFilter(drop)


def _rng_on_undo() -> None:
    rng_logger = logging.getLogger(_RNG_LOGGER)
    for f in [f for f in rng_logger.filters if getattr(f, SENTINEL, None)]:
        rng_logger.removeFilter(f)


def _tracker_add(self: Any, name: str, seed: int) -> None:
    """`CudaRNGStatesTracker.add` on the CPU default generator (random.py:221-240)."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    orig_state = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig_state)


@_register("rng", on_apply=_rng_on_apply, on_undo=_rng_on_undo)
def _build_rng() -> list[Target]:
    """Make the "CUDA" RNG of tensor_parallel/random.py the CPU default generator.

    random.py:55 `_get_cuda_rng_state` and :72-111 `_set_cuda_rng_state` (used by
    `tracker.fork()` and `CheckpointFunction`) -> `torch.get/set_rng_state`;
    :235-238 `CudaRNGStatesTracker.add` -> seeds through `torch.manual_seed` (the cudagraph-safe
    branch is dropped: keep `use_cudagraphable_rng` off); :422 `torch.cuda.manual_seed` is a
    silent no-op on CPU builds, so `model_parallel_cuda_manual_seed` is wrapped to call
    `torch.manual_seed(seed)` first, on `tensor_parallel.random` and on its re-export in
    `tensor_parallel/__init__.py:37`. Real `fork()` semantics are kept (distinct TP streams,
    recompute replay).
    """
    import megatron.core.tensor_parallel as tp_pkg
    import megatron.core.tensor_parallel.random as tp_random

    def get_cuda_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_cuda_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
        torch.set_rng_state(new_state)

    seed_original = original_value(tp_random, "model_parallel_cuda_manual_seed")

    @functools.wraps(seed_original)
    def model_parallel_cuda_manual_seed(seed: int, *args: Any, **kwargs: Any) -> None:
        torch.manual_seed(seed)
        seed_original(seed, *args, **kwargs)

    def add(self: Any, name: str, seed: int) -> None:
        _tracker_add(self, name, seed)

    return [
        (tp_random, "_get_cuda_rng_state", get_cuda_rng_state),
        (tp_random, "_set_cuda_rng_state", set_cuda_rng_state),
        (tp_random.CudaRNGStatesTracker, "add", add),
        (tp_random, "model_parallel_cuda_manual_seed", model_parallel_cuda_manual_seed),
        (tp_pkg, "model_parallel_cuda_manual_seed", model_parallel_cuda_manual_seed),
    ]


@_register("cuda_sync")
def _build_cuda_sync() -> list[Target]:
    """`torch.cuda.synchronize` -> no-op (raises on CPU builds).

    pipeline_parallel/p2p_communication.py:242 (varlen shapes) and :398 (`batch_p2p_sync`);
    dist_checkpointing/strategies/filesystem_async.py:230 (every torch_dist save);
    strategies/fully_parallel.py:272/281; strategies/async_utils.py; timers.py:152/165.
    """

    def synchronize(*_args: Any, **_kwargs: Any) -> None:
        return None

    return [(torch.cuda, "synchronize", synchronize)]


@_register("cuda_literals")
def _build_cuda_literals() -> list[Target]:
    """Module-scoped `torch` proxy rewriting `device="cuda"` in factories to CPU.

    Installed as the global `torch` of each importable module in `CUDA_LITERAL_MODULES`:
    pipeline_parallel/schedules.py:596/983/2138; optimizer/optimizer.py:473/481/485/907/1141;
    optimizer/clip_grads.py:90/103/115/174/207; utils.py:1207; transformer/utils.py:35/40;
    optimizer/grad_scaler.py:15/88/91/94/140; tensor_parallel/data.py:37;
    dist_checkpointing/strategies/state_dict_saver.py:204; dist_checkpointing/exchange_utils.py:
    104/110/326; rerun_state_machine.py:261/265. Nothing outside those modules changes.
    """
    targets: list[Target] = []
    for module_name in CUDA_LITERAL_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:  # optional dependency of that module missing: skip it
            logger.debug("cuda_literals: skipping %s (%s)", module_name, err)
            continue
        targets.append((module, "torch", CpuTorchProxy()))
    return targets


@_register("tensor_cuda")
def _build_tensor_cuda() -> list[Target]:
    """`torch.Tensor.cuda` -> identity when CUDA is unavailable (original otherwise).

    models/common/language_module/language_module.py:244 (tied embeddings at PP>1);
    optimizer/distrib_optimizer.py:1077/1089 (legacy optimizer gather/scatter);
    optimizer/optimizer.py:354-380 (offload reload); dist_checkpointing/exchange_utils.py:
    98-110/336/499; tensor_parallel/data.py:84/86.
    """
    cuda_original = original_value(torch.Tensor, "cuda")

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.cuda.is_available():
            return cuda_original(self, *args, **kwargs)
        return self

    return [(torch.Tensor, "cuda", cuda)]


@_register("type_alias")
def _build_type_alias() -> list[Target]:
    """`Tensor.type()` (no-argument form) reports CPU tensors as `torch.cuda.*Tensor`.

    optimizer/clip_grads.py:167 asserts `param.grad.type() == 'torch.cuda.FloatTensor'`;
    optimizer/distrib_optimizer.py:361/420/582 and optimizer/optimizer.py:671/690 dispatch on
    `param.type()` strings and raise TypeError for `torch.FloatTensor`. Conversion calls
    (`t.type(dtype)`) go to the original. Global, but only the no-argument form changes.
    """
    type_original = original_value(torch.Tensor, "type")

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return type_original(self, *args, **kwargs)
        name = type_original(self)
        if self.device.type == "cpu" and name.startswith("torch.") and ".cuda." not in name:
            return "torch.cuda." + name[len("torch.") :]
        return name

    return [(torch.Tensor, "type", type_)]


class _DummyStream:
    """Stand-in for `torch.cuda.Stream`: accepts anything, waits for nothing."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def wait_stream(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def wait_event(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


@_register("cuda_streams")
def _build_cuda_streams() -> list[Target]:
    """`torch.cuda.Stream/stream/default_stream/current_stream` -> dummies / null context.

    0.16.1: distributed/distributed_data_parallel.py:230 and distributed/param_and_grad_buffer.py:
    417/422/529, reached only with `num_distributed_optimizer_instances > 1` (unexercised by the
    verified scenarios). 0.19: also param_and_grad_buffer.py:632, `current_stream()` and a
    `wait_event` loop (CUDA-graph wgrad events) in every `start_grad_sync`: every DDP step on
    CPU needs it.
    """

    class Stream(_DummyStream):
        pass

    def stream(*_args: Any, **_kwargs: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def default_stream(*_args: Any, **_kwargs: Any) -> _DummyStream:
        return Stream()

    def current_stream(*_args: Any, **_kwargs: Any) -> _DummyStream:
        return Stream()

    return [
        (torch.cuda, "Stream", Stream),
        (torch.cuda, "stream", stream),
        (torch.cuda, "default_stream", default_stream),
        (torch.cuda, "current_stream", current_stream),
    ]


# ------------------------------------------------------- Mixture-of-Experts (transformer/moe/)


def _moe_utils() -> Any:
    return importlib.import_module("megatron.core.transformer.moe.moe_utils")


def _te_gemm_on_apply() -> None:
    moe_utils = _moe_utils()
    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        moe_utils._megatron_ext_te_gemm_stub = True


def _te_gemm_on_undo() -> None:
    moe_utils = _moe_utils()
    if getattr(moe_utils, "_megatron_ext_te_gemm_stub", False):
        del moe_utils.te_general_gemm
        del moe_utils._megatron_ext_te_gemm_stub


@_register("te_gemm_stub", on_apply=_te_gemm_on_apply, on_undo=_te_gemm_on_undo,
           versions=">=0.16.1,<0.19")
def _build_te_gemm_stub() -> list[Target]:
    """Bind `moe_utils.te_general_gemm = None` when Transformer Engine is absent.

    transformer/moe/moe_utils.py:1192/1225 (`RouterGatingLinearFunction`, every MoE router
    forward and backward) test `te_general_gemm is not None`, but the name is bound only inside
    the `try: import transformer_engine` block (:22-38): without TE it is a NameError on any
    device. With the name bound to None the router takes its own torch.mm path. Not a
    CUDA hard-code but a missing fallback; no targets, only the module global (set on apply,
    removed on undo). Fixed upstream in 0.19 (moe_utils.py:27-53 binds it to None without TE).
    """
    return []


class _DummyEvent:
    """Stand-in for the `torch.cuda.Event` a stream records: everything already happened."""

    def synchronize(self) -> None:
        pass

    def wait(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def query(self) -> bool:
        return True


@_register("stream_events")
def _build_stream_events() -> list[Target]:
    """The dummy streams of `cuda_streams` record (dummy) events.

    transformer/moe/token_dispatcher.py:895 `self.cuda_dtoh_stream.record_event()` and :899
    `d2h_event.synchronize()` in `MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`, every
    forward of the alltoall dispatcher (EP=1 included); its side stream is `torch.cuda.Stream()`
    (:445), the `cuda_streams` dummy, which has no `record_event` (AttributeError).
    """

    def record_event(self: Any, *_args: Any, **_kwargs: Any) -> _DummyEvent:
        return _DummyEvent()

    return [(_DummyStream, "record_event", record_event)]


@_register("host_splits")
def _build_host_splits() -> list[Target]:
    """`maybe_move_tensor_to_cpu(t, as_numpy=True)` returns `t.numpy()` for CPU tensors too.

    transformer/moe/moe_utils.py:1093 converts only `tensor.is_cuda` tensors, so on CPU the
    alltoall dispatcher's `input_splits` / `output_splits` (token_dispatcher.py:879-886) stay
    int64 tensors and gloo's `all_to_all_single` rejects them as split sizes (TypeError at
    tensor_parallel/mappings.py:444, ETP x EP > 1). Installed on moe_utils and on
    token_dispatcher, which imports the function by name (token_dispatcher.py:31).
    """
    moe_utils = _moe_utils()
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original = original_value(moe_utils, "maybe_move_tensor_to_cpu")

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False,
                                 record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return [(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu),
            (dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)]


@_register("uneven_gather")
def _build_uneven_gather() -> list[Target]:
    """Uneven all-gather / reduce-scatter along dim 0 on CPU (gloo) tensors.

    tensor_parallel/mappings.py:150 `all_gather(list of split_sizes-sized views)` and :193
    `reduce_scatter(output, list of split_sizes-sized inputs)`: gloo's all_gather needs equal
    sizes and it has no list reduce-scatter. The alltoall dispatcher calls them with the token
    counts each expert-tp rank received (token_dispatcher.py:696 dispatch, :779 combine) when
    ETP > 1 and EP > 1, where the counts differ between ranks. CPU tensors with split sizes:
    gather pads every part to the largest, reduce-scatter all-reduces the whole tensor and keeps
    this rank's rows; everything else goes to the originals.
    """
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    gather_original = original_value(mappings, "_gather_along_first_dim")
    scatter_original = original_value(mappings, "_reduce_scatter_along_first_dim")

    @functools.wraps(gather_original)
    def _gather_along_first_dim(input_: torch.Tensor, group: Any, output_split_sizes: Any = None,
                                use_global_buffer: bool = False) -> torch.Tensor:
        if output_split_sizes is None or input_.is_cuda or group.size() == 1:
            return gather_original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))  # [max rows, ...]
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])

    @functools.wraps(scatter_original)
    def _reduce_scatter_along_first_dim(input_: torch.Tensor, group: Any,
                                        input_split_sizes: Any = None,
                                        use_global_buffer: bool = False) -> torch.Tensor:
        if input_split_sizes is None or input_.is_cuda or group.size() == 1:
            return scatter_original(input_, group, input_split_sizes, use_global_buffer)
        full = input_.contiguous().clone()  # [sum(sizes), ...]
        torch.distributed.all_reduce(full, group=group)
        sizes = [int(n) for n in input_split_sizes]
        return torch.split(full, sizes, dim=0)[group.rank()].contiguous()

    return [(mappings, "_gather_along_first_dim", _gather_along_first_dim),
            (mappings, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim)]


@_register("mla_local_attention")
def _build_mla_local_attention() -> list[Target]:
    """The local `DotProductAttention` takes MLA's separate query/key and value head widths.

    transformer/multi_latent_attention.py:155-166 builds its core attention with
    `k_channels=q_head_dim, v_channels=v_head_dim`, which only Transformer Engine's
    `TEDotProductAttention` accepts; the local spec (models/gpt/gpt_layer_specs.py:376-381, the
    only MLA spec without Transformer Engine) gives `DotProductAttention`, whose `__init__`
    (transformer/dot_product_attention.py:42-52) has no such parameters (TypeError), and whose
    output width (:65, :78) is `kv_channels * heads`. With the two widths given, the scores use
    the query/key width and the output `v_channels * heads / tp` (the forward already takes the
    value's own head width, :230-249); without them nothing changes.

    Also, without Transformer Engine, extensions/transformer_engine.py:74-76 binds its TE names
    to MagicMock attributes, so multi_latent_attention.py:54-62 imports a `TELinear` that is no
    class and `isinstance(self.linear_proj, TELinear)` (:183-185) raises TypeError; it becomes
    a class nothing is an instance of.
    """
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    targets: list[Target] = []
    if not isinstance(original_value(mla, "TELinear"), type):
        targets.append((mla, "TELinear", type("AbsentTELinear", (), {})))
    module = importlib.import_module("megatron.core.transformer.dot_product_attention")
    cls = module.DotProductAttention
    original = original_value(cls, "__init__")

    @functools.wraps(original)
    def __init__(self: Any, config: Any, layer_number: int, attn_mask_type: Any,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None, k_channels: int | None = None,
                 v_channels: int | None = None) -> None:
        original(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                 cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if k_channels is None and v_channels is None:
            return
        heads, tp = config.num_attention_heads, self.tp_group.size()
        k_channels = k_channels or config.kv_channels
        v_channels = v_channels or config.kv_channels
        self.hidden_size_per_attention_head = k_channels
        self.hidden_size_per_partition = v_channels * heads // tp
        if softmax_scale is None:  # :84-90 with the query/key width
            self.softmax_scale = 1.0 / k_channels**0.5
            if config.apply_query_key_layer_scaling:
                self.softmax_scale /= max(1, layer_number)

    return [*targets, (cls, "__init__", __init__)]
