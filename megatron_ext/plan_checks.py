"""Cross-field consistency rules of a ParallelPlan; each failure is one PlanError line.

Kept apart from plan.py so the rules read as a list. Errors name layers as `layers[7]` or
`layers[8:16]` (global, zero-based, half-open), the same indexing the JSON ranges use.

This is the one validity check: every plan is checked here when it is built (so `validate`,
`args`, `plan-from-args` and the runtime, which all load or build a ParallelPlan, refuse the same
plans), and the rules that do not need a whole plan are public so the search and the Megatron
flag checks apply them to their inputs before any work (`check_sequence`,
`vocab_parallel_split`): no command accepts what another refuses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_ext.errors import PlanError

if TYPE_CHECKING:
    from megatron_ext.plan import LayerStrategy, ParallelPlan
    from megatron_ext.specs import ClusterSpec, FP8Spec, ModelSpec


def check_sequence(
    seq_length: int,
    max_position_embeddings: int,
    *,
    seq_name: str = "seq_length",
    max_name: str = "model.max_position_embeddings",
) -> None:
    """Megatron-LM's validate_args asserts max_position_embeddings >= seq_length for every
    position embedding type, rope included (megatron/training/arguments.py, core_v0.16.1)."""
    if seq_length > max_position_embeddings:
        raise PlanError(
            f"{seq_name}={seq_length} exceeds {max_name}={max_position_embeddings}; Megatron-LM "
            f"requires --max-position-embeddings >= --seq-length: raise {max_name} or lower "
            f"{seq_name}"
        )


def vocab_parallel_split(
    *, stage_width: int, vocab_tp: int, micro_batch_size: int, seq_length: int
) -> tuple[int, int]:
    """(dp, seq) of the vocabulary passes under vocab.mode vocab_parallel: the stage_width /
    vocab_tp ranks beside each tensor-parallel group split the micro-batch as far as it goes
    (dp) and the sequence for the rest (seq); geometry/vocab.py builds its layout from
    this. PlanError when the sequence does not split."""
    rest = stage_width // vocab_tp
    dp = max(d for d in range(1, rest + 1) if rest % d == 0 and micro_batch_size % d == 0)
    seq = rest // dp
    if seq_length % seq:
        raise PlanError(
            f"seq_length={seq_length} cannot be split over the {seq} vocabulary replicas "
            f"that micro_batch_size={micro_batch_size} leaves; use a micro-batch size that "
            f"is a multiple of {rest} or a seq_length divisible by {seq}"
        )
    return dp, seq


def check_plan(plan: ParallelPlan) -> None:
    _check_world(plan)
    _check_stages(plan)
    if len(plan.layers) != plan.model.num_layers:
        raise PlanError(
            f"layers cover {len(plan.layers)} layers but model.num_layers="
            f"{plan.model.num_layers}; give one strategy per layer"
        )
    for start, end, strategy in plan.layer_runs():
        label = f"layers[{start}]" if end - start == 1 else f"layers[{start}:{end}]"
        _check_layer(plan, strategy, label, start)
        _check_experts(plan, strategy, start, end)
    _check_batch(plan)
    _check_vocab(plan)
    _check_flexsp(plan)
    _check_overlap(plan)
    _check_tp_comm_overlap(plan)
    _check_fp8(plan)
    _check_prediction(plan)


def _check_world(plan: ParallelPlan) -> None:
    if plan.world_size < 1 or plan.pp < 1:
        raise PlanError(f"world_size={plan.world_size} and pp={plan.pp} must be >= 1")
    if plan.world_size % plan.pp:
        raise PlanError(
            f"pp={plan.pp} does not divide world_size={plan.world_size}; choose a divisor"
        )
    if plan.cluster is not None and plan.cluster.num_gpus != plan.world_size:
        raise PlanError(
            f"world_size={plan.world_size} but cluster has {plan.cluster.num_gpus} GPUs "
            f"(num_nodes={plan.cluster.num_nodes} x gpus_per_node={plan.cluster.gpus_per_node}); "
            "make them equal"
        )


def _check_stages(plan: ParallelPlan) -> None:
    v = plan.virtual_stages
    if v < 1:
        raise PlanError(f"virtual_stages={v} must be >= 1 (model chunks per pipeline rank)")
    if v > 1 and plan.pp == 1:
        raise PlanError(
            f"virtual_stages={v} needs pp > 1 (it interleaves model chunks over pipeline "
            "ranks); use virtual_stages=1"
        )
    if len(plan.stages) != plan.pp * v:
        what = "pp" if v == 1 else f"pp*virtual_stages={plan.pp}*{v}"
        raise PlanError(
            f"stages has {len(plan.stages)} ranges but {what}={plan.pp * v}; give one per "
            + ("pipeline stage" if v == 1 else "model chunk (chunk c of rank r is "
               "stages[c*pp + r])")
        )
    expected_start = 0
    for i, (start, end) in enumerate(plan.stages):
        if start != expected_start:
            raise PlanError(
                f"stages[{i}].start={start} but the previous stage ends at {expected_start}; "
                "stages must be contiguous"
            )
        if end <= start:
            raise PlanError(f"stage {i} is empty ([{start}, {end})); give it at least one layer")
        expected_start = end
    if expected_start != plan.model.num_layers:
        raise PlanError(
            f"stages end at layer {expected_start} but model.num_layers={plan.model.num_layers}; "
            "the last stage must end at num_layers"
        )
    m = plan.num_microbatches if plan.micro_batch_size > 0 else 0
    if v > 1 and (m < plan.pp or m % plan.pp):
        # megatron-core 0.16.1 pipeline_parallel/schedules.py:992-1012 refuses other counts.
        raise PlanError(
            f"virtual_stages={v} needs the micro-batch count (global_batch_size/"
            f"micro_batch_size={m}) to be a multiple of pp={plan.pp}, as megatron-core's "
            "interleaved schedule requires; change global_batch_size or micro_batch_size"
        )
    if v > 1 and plan.vocab.mode == "vocab_parallel":
        raise PlanError(
            f"virtual_stages={v} with vocab.mode='vocab_parallel' is not supported: the "
            "vocabulary passes run on the non-interleaved 1F1B schedule only; use vocab.mode "
            "'tp' or virtual_stages=1"
        )


def _width_message(plan: ParallelPlan, s: LayerStrategy, label: str, first: int) -> str:
    """tp*cp*ulysses*dp != world_size/pp: name the field to change. dp when the others divide
    the stage width (the dp that fits is said), else the first of tp, cp, ulysses that does
    not divide what the others leave."""
    width = plan.stage_width
    head = (f"tp*cp*ulysses*dp of layer {first} is {s.width} but world_size/pp is {width} "
            f"(world_size={plan.world_size}, pp={plan.pp})")
    model_parallel = s.tp * s.cp * s.ulysses
    if width % model_parallel == 0:
        return f"{head}; set {label}.dp={width // model_parallel}"
    for name in ("tp", "cp", "ulysses"):
        value = getattr(s, name)
        others = model_parallel // value
        if width % others == 0 and (width // others) % value:
            rest = width // others
            fits = ", ".join(str(d) for d in range(1, rest + 1) if rest % d == 0)
            of = "world_size/pp" if others == 1 else "world_size/pp over the other degrees"
            return (f"{head}; {label}.{name}={value} does not divide {rest} ({of}): use one of "
                    f"{fits} and set dp so that tp*cp*ulysses*dp = {width}")
    return f"{head}; lower {label}.tp, cp or ulysses to divide {width}"


def _check_layer(plan: ParallelPlan, s: LayerStrategy, label: str, first: int) -> None:
    model = plan.model
    if s.width != plan.stage_width:
        raise PlanError(_width_message(plan, s, label, first))
    if model.num_attention_heads % s.tp:
        raise PlanError(
            f"{label}.tp={s.tp} does not divide num_attention_heads={model.num_attention_heads}"
            + ("; multi-latent attention splits its heads over tp: use a tp that divides them"
               if model.mla is not None else "")
        )
    if model.mla is not None and s.ulysses > 1:
        # TE's context-parallel attention with q/k and v head widths that differ takes only
        # cp_comm_type p2p or a2a+p2p; megatron_ext's Ulysses attention assumes one width
        raise PlanError(f"{label}.ulysses={s.ulysses} with model.mla: Ulysses attention is not "
                        "supported for multi-latent attention (its q/k and v head widths differ);"
                        " use cp (ring attention) instead")
    if model.num_query_groups % s.tp:
        raise PlanError(
            f"{label}.tp={s.tp} does not divide num_query_groups={model.num_query_groups}"
        )
    if s.ulysses > 1 and s.tp * s.ulysses > model.num_query_groups:
        raise PlanError(
            f"{label}.ulysses={s.ulysses} exceeds num_query_groups={model.num_query_groups}"
            + (f" / tp={s.tp}" if s.tp > 1 else "") + "; lower ulysses or use cp"
        )
    if model.num_query_groups % (s.tp * s.ulysses):
        raise PlanError(
            f"{label}.ulysses={s.ulysses} does not divide num_query_groups/tp="
            f"{model.num_query_groups // s.tp}"
        )
    chunks = (s.tp if s.sp else 1) * s.ulysses * (2 * s.cp if s.cp > 1 else 1)
    if plan.seq_length % chunks:
        raise PlanError(
            f"seq_length={plan.seq_length} is not divisible by {chunks}, the sequence chunks of "
            f"{label} (tp if sp) * ulysses * (2*cp if cp>1); change seq_length or the degrees"
        )


def _check_experts(plan: ParallelPlan, s: LayerStrategy, start: int, end: int) -> None:
    """ep/etp on MoE layers only, and the rules megatron-core's MoELayer asserts."""
    model = plan.model
    moe_layers = [i for i in range(start, end) if model.is_moe_layer(i)]
    if s.has_expert_dims and len(moe_layers) < end - start:
        dense = next(i for i in range(start, end) if not model.is_moe_layer(i))
        raise PlanError(
            f"layers[{dense}] is a dense layer but has ep={s.ep}, etp={s.etp}; expert degrees "
            "apply to MoE layers only (model.moe.layer_freq): drop ep/etp there"
        )
    if not moe_layers or model.moe is None:
        return
    label = f"layers[{start}]" if end - start == 1 else f"layers[{start}:{end}]"
    if model.moe.num_experts % s.ep:
        raise PlanError(f"{label}.ep={s.ep} does not divide model.moe.num_experts="
                        f"{model.moe.num_experts}; use a divisor")
    if s.width % (s.ep * s.expert_tp):
        raise PlanError(f"{label}: ep*etp={s.ep * s.expert_tp} does not divide the layer's "
                        f"{s.width} ranks (tp*cp*ulysses*dp); lower ep or etp")
    ffn = model.moe.expert_ffn_hidden_size(model)
    if ffn % s.expert_tp:
        raise PlanError(f"{label}.etp={s.expert_tp} does not divide the expert FFN width {ffn}")
    if s.tp > 1 and not s.sp:
        # megatron-core 0.16.1 moe_layer.py:379-383 refuses MoE with tp > 1 without SP.
        raise PlanError(f"{label} is an MoE layer with tp={s.tp} but sp=false; megatron-core's "
                        "MoE layer needs sequence parallelism with tensor parallelism: set sp")


def _check_batch(plan: ParallelPlan) -> None:
    if plan.global_batch_size % plan.micro_batch_size:
        raise PlanError(
            f"global_batch_size={plan.global_batch_size} is not a multiple of "
            f"micro_batch_size={plan.micro_batch_size}"
        )
    for start, end, s in plan.layer_runs():
        if plan.micro_batch_size % s.dp:
            label = f"layers[{start}]" if end - start == 1 else f"layers[{start}:{end}]"
            raise PlanError(
                f"micro_batch_size={plan.micro_batch_size} does not split over {label}.dp={s.dp}; "
                "micro_batch_size counts samples over all data-parallel replicas: use a multiple "
                f"of {s.dp}"
            )
    check_sequence(plan.seq_length, plan.model.max_position_embeddings)


def _check_vocab(plan: ParallelPlan) -> None:
    if plan.stage_width % plan.vocab.tp:
        raise PlanError(
            f"vocab.tp={plan.vocab.tp} does not divide world_size/pp={plan.stage_width}"
        )
    model = plan.model
    for field in ("num_attention_heads", "num_query_groups"):
        # the embedding and output layer are built from megatron-core's TransformerConfig at
        # vocab.tp, which refuses a tp that does not divide the heads or query groups
        if getattr(model, field) % plan.vocab.tp:
            raise PlanError(
                f"vocab.tp={plan.vocab.tp} does not divide {field}={getattr(model, field)}; "
                "megatron-core builds the vocabulary layers with that tp: use a vocab.tp that "
                "divides it"
            )
    if plan.vocab.mode == "vocab_parallel" and plan.pp == 1:
        raise PlanError(
            "vocab.mode='vocab_parallel' needs pp > 1 (it spreads the vocabulary over pipeline "
            "stages); use mode 'tp' with pp=1"
        )
    if plan.vocab.mode == "vocab_parallel":
        vocab_parallel_split(
            stage_width=plan.stage_width,
            vocab_tp=plan.vocab.tp,
            micro_batch_size=plan.micro_batch_size,
            seq_length=plan.seq_length,
        )


def _check_overlap(plan: ParallelPlan) -> None:
    """Megatron-LM's rules for --overlap-param-gather (validate_args): it needs
    --overlap-grad-reduce and a distributed optimizer or Megatron-FSDP (here: a layer with
    ZeRO >= 1)."""
    if not plan.overlap_param_gather:
        return
    if not plan.overlap_grad_reduce:
        raise PlanError("overlap_param_gather=true needs overlap_grad_reduce=true (Megatron-LM's "
                        "--overlap-param-gather needs --overlap-grad-reduce); set both or drop it")
    if not any(s.zero >= 1 for s in plan.layers):
        raise PlanError("overlap_param_gather=true needs a ZeRO-1 layer (Megatron-LM's "
                        "--overlap-param-gather needs --use-distributed-optimizer); drop it")


def _check_tp_comm_overlap(plan: ParallelPlan) -> None:
    """Megatron-LM's rule for --tp-comm-overlap (validate_args, megatron/training/arguments.py
    core_v0.16.1:915): it needs --sequence-parallel, which validate_args turns off at tp = 1
    (line 907). Per layer: some layer has tp > 1, and every layer with tp > 1 has sp."""
    if not plan.tp_comm_overlap:
        return
    if not any(s.tp > 1 and s.sp for s in plan.layers):
        raise PlanError("tp_comm_overlap=true needs a layer with tp > 1 and sp=true (Megatron-LM's "
                        "--tp-comm-overlap needs --sequence-parallel, which tp=1 turns off); "
                        "drop tp_comm_overlap or use tp > 1 with sp")
    for start, end, s in plan.layer_runs():
        if s.tp > 1 and not s.sp:
            raise PlanError(f"tp_comm_overlap=true needs sp=true in every layer with tp > 1, "
                            f"layers[{start}:{end}] has tp={s.tp} sp=false (Megatron-LM's "
                            "--tp-comm-overlap needs --sequence-parallel); set sp or drop "
                            "tp_comm_overlap")


def _check_flexsp(plan: ParallelPlan) -> None:
    if plan.flexsp is None:
        return
    for start, end, s in plan.layer_runs():
        if plan.pp != 1 or s.tp != 1 or s.cp != 1 or s.ulysses != 1:
            raise PlanError(
                f"flexsp needs pp=1 and tp=cp=ulysses=1 in every layer (got pp={plan.pp}, "
                f"layers[{start}:{end}] {s.describe()}); FlexSP picks sequence-parallel groups "
                "per step"
            )
    if plan.flexsp.max_group_size > plan.world_size:
        raise PlanError(
            f"flexsp.max_group_size={plan.flexsp.max_group_size} exceeds world_size="
            f"{plan.world_size}"
        )
    if plan.model.num_attention_heads % plan.flexsp.max_group_size:
        raise PlanError(
            f"flexsp.max_group_size={plan.flexsp.max_group_size} does not divide "
            f"num_attention_heads={plan.model.num_attention_heads}"
        )


def _check_prediction(plan: ParallelPlan) -> None:
    pred = plan.prediction
    if pred is None:
        return
    for name in ("stage_peak_memory_gib", "stage_time_s"):
        values = getattr(pred, name)
        if values and len(values) != plan.pp:
            raise PlanError(
                f"prediction.{name} has {len(values)} entries but pp={plan.pp}; give one per "
                "pipeline rank or none"
            )
        if any(v < 0 for v in values):
            raise PlanError(f"prediction.{name} has a negative entry; times and memory are >= 0")
    if pred.mfu < 0:
        raise PlanError(f"prediction.mfu={pred.mfu} must be >= 0")


FP8_DIM_MULTIPLE = 16
"""Transformer Engine runs an FP8 GEMM only on dimensions that are multiples of 16
(transformer_engine/pytorch/utils.py check_dim_for_fp8_exec; rows of 8 and columns of 16)."""


def check_fp8_cluster(fp8: FP8Spec, cluster: ClusterSpec) -> None:
    """The GPU runs FP8 and this recipe (mxfp8 needs Blackwell)."""
    if not cluster.peak_fp8_flops:
        raise PlanError(f"fp8.recipe={fp8.recipe!r} on cluster {cluster.name!r}: its GPUs have "
                        "no FP8 tensor cores (cluster.peak_fp8_flops is 0); train in bf16 or "
                        "use a Hopper / Blackwell cluster")
    if fp8.recipe not in cluster.fp8_recipes:
        raise PlanError(f"fp8.recipe={fp8.recipe!r} is not supported by the GPUs of cluster "
                        f"{cluster.name!r} (they run {', '.join(cluster.fp8_recipes)}); use "
                        "--fp8-recipe " + " or ".join(cluster.fp8_recipes))


def check_fp8_shapes(model: ModelSpec, tp: int, label: str, *, expert_tp: int = 0) -> None:
    """Every per-rank dimension of the layer's weight GEMMs is a multiple of FP8_DIM_MULTIPLE."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q = model.num_attention_heads * model.head_dim
    kv = model.num_query_groups * model.head_dim
    dims = {"hidden_size": h, "(q + 2 kv) / tp": (q + 2 * kv) / tp, "q / tp": q / tp,
            "ffn_hidden_size / tp": f / tp}
    if expert_tp and model.moe is not None:
        expert_f = model.moe.expert_ffn_hidden_size(model)
        dims["moe ffn_hidden_size / expert tp"] = expert_f / expert_tp
    for name, dim in dims.items():
        if dim != int(dim) or int(dim) % FP8_DIM_MULTIPLE:
            raise PlanError(f"{label}: FP8 GEMM dimension {name} = {dim:g} is not a multiple of "
                            f"{FP8_DIM_MULTIPLE} (Transformer Engine refuses it); keep the "
                            "layer in bf16 (fp8.bf16_layers), change the tensor-parallel size, "
                            "or train without --fp8-format")


def _check_fp8(plan: ParallelPlan) -> None:
    fp8 = plan.fp8
    if fp8 is None:
        return
    n = plan.model.num_layers
    bad = [i for i in fp8.bf16_layers if not 0 <= i < n]
    if bad:
        raise PlanError(f"fp8.bf16_layers has layer {bad[0]} outside [0, {n}); use global "
                        "zero-based layer indices")
    for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        if getattr(fp8, name) > n / plan.pp:  # Megatron-LM transformer_config.py:994-1017
            raise PlanError(f"fp8.{name}={getattr(fp8, name)} exceeds num_layers / pp = "
                            f"{n / plan.pp:g}; lower it")
    if fp8.param_gather and any(s.zero != 1 for s in plan.layers):
        # Megatron-LM arguments.py:655-657 (distributed optimizer), :625-630 (off with FSDP2)
        zero = next(s.zero for s in plan.layers if s.zero != 1)
        raise PlanError(f"fp8.param_gather (--fp8-param-gather) with a zero={zero} layer: FP8 "
                        "parameters are gathered by the distributed optimizer; use "
                        "--use-distributed-optimizer (zero=1) everywhere or drop it")
    if plan.flexsp is not None:
        raise PlanError("fp8 with flexsp: the FlexSP runtime has no FP8 path; drop one")
    for start, end, s in plan.layer_runs():
        if any(fp8.layer_in_fp8(i, n) for i in range(start, end)):
            label = f"layers[{start}]" if end - start == 1 else f"layers[{start}:{end}]"
            moe = any(plan.model.is_moe_layer(i) for i in range(start, end))
            check_fp8_shapes(plan.model, s.tp, label, expert_tp=s.expert_tp if moe else 0)
    if plan.cluster is not None:
        check_fp8_cluster(fp8, plan.cluster)
