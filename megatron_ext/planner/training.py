"""Training settings the search is asked about: batch, sequence, precision and allowed features."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from megatron_ext.errors import PlanError
from megatron_ext.specs import FP8Spec

Precision = Literal["bf16", "fp16", "fp32"]
Engine = Literal["megatron", "deepspeed", "deepspeed-bf16"]
ENGINES: tuple[str, ...] = get_args(Engine)

BF16_OPTIMIZER_REDUCE_BYTES = 2
"""Bytes per gradient in DeepSpeed's BF16_Optimizer reduction: its pipeline engine all-reduces
the optimizer's fp32 gradient buffer (PipelineEngine._bf16_reduce_grads) and the engine without
it the parameters' bf16 .grad (allreduce_gradients at ZeRO stage 0); both go through
DeepSpeedEngine.allreduce_bucket, which casts to communication_data_type, bf16 in a bf16 run
unless the config sets it (DeepSpeed v0.12.6 runtime/engine.py)."""

BF16_OPTIMIZER_ACCUMULATE_BYTES = 20.0
"""HBM bytes per parameter DeepSpeed's BF16_Optimizer moves after every micro-batch's backward
(PipelineEngine._exec_backward_pass, v0.12.6: clear_lp_grads zeroes the bf16 .grad, 2;
update_hp_grads adds it into the fp32 buffer as hp_grad.add_(lp.grad.to(fp32)): read 2, write
and read the fp32 copy 4 + 4, read and write the buffer 4 + 4)."""

DEEPSPEED_MAX_LIVE_PARAMS = 1e9
"""DeepSpeed ZeRO-3's default stage3_max_live_parameters: it gathers module by module and holds
at most this many parameters gathered, where FSDP2 and Megatron-FSDP hold two whole layers."""

DEFAULT_MOE_IMBALANCE = 1.2
"""Default MoE load-imbalance factor rho: tokens the busiest rank's experts receive over the
mean (planner/cost/moe.py scales expert compute, all-to-all volume and routed activations by it).
Source: Switch Transformer (Fedus et al., JMLR 2022, arXiv 2101.03961, Sec. 2.2 and Table 1)
trains with the load-balancing loss at expert capacity factors 1.0-1.25 and drops under 1% of the
tokens at 1.25, i.e. the busiest expert stays within ~1.25x the mean; a rank holds E/ep experts,
whose sum varies less than one expert's load, so 1.2. Override with `search --moe-imbalance`
(1.0 = perfectly balanced, e.g. Megatron-LM's --moe-router-force-load-balancing benchmarks)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingSpec:
    """What one optimizer step looks like, and which layouts the search may use."""

    global_batch_size: int
    """Samples per optimizer step (--global-batch-size)."""
    seq_length: int
    """Tokens per sample (--seq-length)."""
    precision: Precision = "bf16"
    """bf16/fp16: mixed precision (half weights, fp32 main grads, fp32 master + 2 Adam states);
    fp32: everything in fp32."""
    num_optimizer_states: int = 2
    """fp32 states per parameter kept by the optimizer (Adam: exp_avg and exp_avg_sq)."""
    allow_vocab_parallel: bool = True
    """May spread embedding + output layer + cross-entropy over all pp x tp ranks."""
    allow_ulysses: bool = True
    """May use Ulysses sequence parallelism (not expressible with stock Megatron-LM flags)."""
    allow_cp: bool = True
    """May use context parallelism."""
    allow_zero3: bool = True
    """Layers may shard gradients (ZeRO-2) or everything (ZeRO-3) over their data-parallel
    group, as the layerwise runtime runs them (FSDP2 per layer). False keeps the search to
    zero 0/1 (e.g. to plan for a runtime without them). The search is exact in this flag:
    allowing it never gives a slower plan."""
    allow_interleaving: bool = True
    """The pipeline may run Megatron's interleaved schedule (virtual_stages > 1 model chunks per
    rank; --num-layers-per-virtual-pipeline-stage), in the uniform baseline and the search.
    Exact in the same sense: a non-interleaved layout stays in the space."""
    allow_flexsp: bool = False
    """Recorded for the FlexSP planner; the layerwise search itself never emits a FlexSP plan."""
    flash_attention: bool = True
    """Attention scores are never stored (flash / fused attention), as with Transformer Engine."""
    dropout: bool = True
    """Hidden dropout is on (Megatron's default 0.1): one byte of mask per activation element."""
    moe_imbalance: float = DEFAULT_MOE_IMBALANCE
    """MoE load-imbalance factor (DEFAULT_MOE_IMBALANCE); read only for models with experts."""
    overlap_grad_reduce: bool = False
    """Megatron-LM's --overlap-grad-reduce: the data-parallel gradient reduction runs bucket by
    bucket during the last micro-batch's backward. Off (Megatron-LM's default, and all the
    2020-2022 Megatron code): it runs after the last backward, on the critical path, as one
    bucket per gradient buffer."""
    overlap_param_gather: bool = False
    """Megatron-LM's --overlap-param-gather (needs overlap_grad_reduce and a distributed
    optimizer): ZeRO-1's weight all-gather overlaps the next iteration's first forward. Off
    (default): it runs after the optimizer step, on the critical path."""
    tp_comm_overlap: bool = False
    """Megatron-LM's --tp-comm-overlap (Transformer Engine userbuffers): each sequence-parallel
    all-gather / reduce-scatter of a layer with tp > 1 and sp is pipelined with the GEMM it
    feeds or follows and costs only what that GEMM cannot hide (cost/tp_overlap.py). Off
    (default): on the critical path. Priced only; `search` never sets it (the training runtime
    refuses it)."""
    overlap_p2p_comm: bool = False
    """Megatron-LM's interleaved schedule overlaps its pipeline messages with compute
    (overlap_p2p_comm: on by default with virtual stages; --no-overlap-p2p-communication turns
    it off): a message costs only what outlasts the chunk's forward beside it
    (cost/evaluate.overlapped_p2p_s). Off (default): every message is on the critical path, as
    in megatron_ext's layerwise runtime (it sends and waits), in 1F1B without interleaving and in
    the Megatron code before Megatron-Core. Read only with virtual stages."""
    engine: Engine = "megatron"
    """What runs the step. megatron: Megatron-LM / megatron_ext, the gradient reduction and
    ZeRO-1's weight all-gather as the two overlap flags above say, ZeRO-3 gathers two whole
    layers.
    deepspeed: Megatron-DeepSpeed's engine, with or without its pipeline module: at ZeRO stage
    0-1 gradients are reduced and ZeRO-1's weights gathered after the last micro-batch's
    backward, not overlapped (overlap_comm is off by default there); at stage 3 the
    reduce-scatter overlaps as with FSDP, and at most DEEPSPEED_MAX_LIVE_PARAMS parameters are
    held gathered (stage3_max_live_parameters).
    deepspeed-bf16: DeepSpeed's engine with its BF16_Optimizer, what a bf16 run whose DeepSpeed
    config says ZeRO stage 0 gets (DeepSpeed 0.9-0.14): fp32 master weights and Adam moments
    split over the data-parallel ranks (the plan's layers are zero 1) and the updated bf16
    weights all-gathered after the step, as ZeRO-1; but the gradients all-reduced, not
    reduce-scattered, after the last backward, in bf16 (BF16_OPTIMIZER_REDUCE_BYTES), and every
    parameter's bf16 .grad kept beside the optimizer's full fp32 gradient buffer
    (`keeps_half_grads`), which it accumulates into after every micro-batch's backward
    (BF16_OPTIMIZER_ACCUMULATE_BYTES of HBM traffic per parameter)."""
    fp8: FP8Spec | None = None
    """FP8 training as the user's flags give it (--fp8-format ...): which layers run FP8 is
    theirs; the search prices it (planner/cost/fp8.py) and places the layouts around it."""
    reserve_gib: float | None = None
    """Memory per GPU kept free for the CUDA context, NCCL buffers and allocator fragmentation;
    None means 1 GiB + 4% of the GPU's memory."""

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise PlanError(f"--global-batch-size={self.global_batch_size} must be >= 1")
        if self.seq_length < 1:
            raise PlanError(f"--seq-length={self.seq_length} must be >= 1")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise PlanError(f"--precision={self.precision!r} must be bf16, fp16 or fp32")
        if self.num_optimizer_states < 0:
            raise PlanError(f"num_optimizer_states={self.num_optimizer_states} must be >= 0")
        if not self.moe_imbalance >= 1.0:
            raise PlanError(f"--moe-imbalance={self.moe_imbalance} must be >= 1 (busiest rank's "
                            "routed tokens over the mean; 1 = balanced)")
        if self.engine not in ENGINES:
            raise PlanError(f"--engine={self.engine!r} must be one of {', '.join(ENGINES)}")
        if self.engine == "deepspeed-bf16" and self.precision != "bf16":
            raise PlanError(f"--engine deepspeed-bf16 is DeepSpeed's bf16 optimizer; the plan's "
                            f"precision is {self.precision}: use --engine deepspeed")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise PlanError("--overlap-param-gather needs --overlap-grad-reduce")
        if self.is_deepspeed and self.overlap_grad_reduce:
            raise PlanError(f"--overlap-grad-reduce is Megatron-LM's; --engine {self.engine} "
                            "reduces the gradients after the last backward: drop one of them")
        if self.reserve_gib is not None and self.reserve_gib < 0:
            raise PlanError(f"reserve_gib={self.reserve_gib} must be >= 0")

    @property
    def is_deepspeed(self) -> bool:
        """DeepSpeed's engine runs the step (either `engine` of it)."""
        return self.engine != "megatron"

    @property
    def zero1_grad_reduce(self) -> tuple[Literal["reduce_scatter", "all_reduce"], int]:
        """(collective, bytes per gradient) of a ZeRO-1 layer's gradient reduction: Megatron's
        distributed optimizer and DeepSpeed's ZeRO-1 reduce-scatter grad_reduce_bytes per
        gradient; DeepSpeed's BF16_Optimizer all-reduces them in bf16
        (BF16_OPTIMIZER_REDUCE_BYTES)."""
        if self.engine == "deepspeed-bf16":
            return "all_reduce", BF16_OPTIMIZER_REDUCE_BYTES
        return "reduce_scatter", self.grad_reduce_bytes

    @property
    def keeps_half_grads(self) -> bool:
        """Every parameter's half-precision .grad is kept beside the fp32 gradient: DeepSpeed's
        BF16_Optimizer (`deepspeed-bf16`) accumulates the bf16 grads into its own fp32 copy."""
        return self.engine == "deepspeed-bf16"

    @property
    def half_precision(self) -> bool:
        return self.precision != "fp32"

    @property
    def grad_reduce_bytes(self) -> int:
        """Bytes per gradient element in the data-parallel reduction: fp16 runs accumulate and
        reduce in fp16 (Megatron-LM's --accumulate-allreduce-grads-in-fp32 is off by default);
        bf16 forces fp32 ("bfloat16 requires gradient accumulation and all-reduce to be done in
        fp32", megatron/training/arguments.py); fp32 is fp32."""
        return 2 if self.precision == "fp16" else 4

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element (2 in bf16/fp16, 4 in fp32)."""
        return 2 if self.half_precision else 4

    def reserve_bytes(self, memory_gib: float) -> float:
        gib = self.reserve_gib if self.reserve_gib is not None else 1.0 + 0.04 * memory_gib
        return gib * 2**30
