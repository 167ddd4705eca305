"""Megatron-LM flags -> ParallelPlan (`megatron-ext plan-from-args -- <flags>`), and the
--strategy-config consistency check.

A stock Megatron command line describes a uniform layout: every layer gets the same
LayerStrategy, with dp = world_size / (tp * pp * cp) as in Megatron-LM. The plan fields no
Megatron flag carries come out as: model.name "custom", cluster None, prediction None
(and ModelSpec.kv_channels 0 unless --kv-channels was given). args.py documents the mapping.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from megatron_ext.errors import PlanError
from megatron_ext.flags.emit import PLAN_ONLY, megatron_values
from megatron_ext.flags.fp8 import fp8_from_args
from megatron_ext.flags.mla import mla_from_args, mla_mismatch
from megatron_ext.flags.moe import _SPEC_FLAG, moe_from_args
from megatron_ext.flags.table import EMIT_TABLE, FLAG_OF_DEST
from megatron_ext.plan import FlexSPConfig, LayerStrategy, ParallelPlan, VocabStrategy
from megatron_ext.specs import ModelSpec

_MAX_LAYOUT_CHARS = 1_000_000
MODEL_DESTS = frozenset(dest for concern, dest, _, _ in EMIT_TABLE if concern == "model")
_CHECKED_DESTS = frozenset(
    dest for concern, dest, _, _ in EMIT_TABLE if concern not in ("model", "moe", "mla", "ddp")
) - {"gradient_accumulation_fusion", "strategy_config", "attention_dropout",
     "expert_model_parallel_size", "expert_tensor_parallel_size"}
"""Compared one by one with the plan under --strategy-config; the model and MoE flags are
compared as the ModelSpec they give, the expert degrees against the plan's MoE layers. The
overlap flags (concern "ddp") are run settings: the plan's fill in what the flags leave out,
and a flag given turns its overlap on whatever the plan says (Megatron-LM has no flag to turn
one off)."""
_MODEL_FLAG = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size", "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups", "vocab_size": "--vocab-size",
    "kv_channels": "--kv-channels", "tied_embeddings": "--untie-embeddings-and-output-weights",
    "activation": "--swiglu", "normalization": "--normalization",
    "position_embedding": "--position-embedding-type",
    "max_position_embeddings": "--max-position-embeddings",
    "add_bias_linear": "--disable-bias-linear", "add_qkv_bias": "--add-qkv-bias",
    "qk_layernorm": "--qk-layernorm", "norm_epsilon": "--norm-epsilon",
    "rotary_base": "--rotary-base", "rotary_percent": "--rotary-percent",
    "rope_scaling": "--use-rope-scaling", "rope_scaling_factor": "--rope-scaling-factor",
}


def plan_from_megatron_args(
    ns: argparse.Namespace, world_size: int, *, vocab_size: int | None = None
) -> ParallelPlan:
    """The plan a validated Megatron namespace describes on `world_size` ranks.

    `vocab_size` overrides --vocab-size (pass the tokenizer's size when it is known).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"world size {world_size!r} must be a positive integer")
    if ns.strategy_config is not None:
        plan = getattr(ns, "strategy_plan", None) or _load_plan(ns.strategy_config)
        _check_world(plan, world_size, ns.strategy_config)
        return plan
    model = model_from_args(ns, vocab_size=vocab_size)
    tp, pp, cp_total = (ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size,
                        ns.context_parallel_size)
    dp = data_parallel_size(ns, world_size)
    mbs = _need(ns, "micro_batch_size")
    gbs = ns.global_batch_size or mbs * dp
    if gbs % (mbs * dp):
        raise PlanError(
            f"--global-batch-size={gbs} is not a multiple of --micro-batch-size x data-parallel "
            f"size = {mbs} x {dp}; change the batch sizes"
        )
    cp, ulysses = context_from_args(ns)
    sizes = stage_sizes(ns, model.num_layers)  # one per model chunk
    stages = tuple((sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes)))
    ep, etp = expert_degrees(ns)
    strategies = {
        (kind, moe): LayerStrategy(tp=tp, sp=bool(ns.sequence_parallel) and tp > 1, cp=cp,
                                   ulysses=ulysses, dp=dp, zero=zero_from_args(ns),
                                   recompute=kind, ep=ep if moe else 1,
                                   etp=etp if moe else None)
        for kind in ("none", "selective", "full") for moe in (False, True)
    }
    recompute = recompute_from_args(ns, stages)
    fp8 = fp8_from_args(ns)
    assert cp_total == cp * ulysses, (cp_total, cp, ulysses)
    try:
        return ParallelPlan(
            world_size=world_size, pp=pp, stages=stages, virtual_stages=len(sizes) // pp,
            layers=tuple(strategies[kind, model.is_moe_layer(i)]
                         for i, kind in enumerate(recompute)), model=model,
            micro_batch_size=mbs * dp, global_batch_size=gbs, seq_length=_need(ns, "seq_length"),
            vocab=VocabStrategy(mode="vocab_parallel" if ns.vocab_parallel else "tp", tp=tp,
                                algorithm=ns.vocab_parallel_algorithm),
            precision="bf16" if ns.bf16 else "fp16" if ns.fp16 else "fp32",
            fp8=fp8,
            flexsp=FlexSPConfig(max_group_size=ns.flexsp_max_group_size,
                                min_group_size=ns.flexsp_min_group_size) if ns.flexsp else None,
            overlap_grad_reduce=bool(ns.overlap_grad_reduce),
            overlap_param_gather=bool(ns.overlap_param_gather),
            tp_comm_overlap=bool(ns.tp_comm_overlap),
        )
    except PlanError as err:
        raise PlanError(f"these Megatron flags give an invalid layout: {err}") from None


def expert_degrees(ns: argparse.Namespace) -> tuple[int, int | None]:
    """(ep, etp) of the MoE layers. etp is None (the plan's "same as tp") unless
    --expert-tensor-parallel-size was given with a value other than the tensor-parallel size."""
    ep = ns.expert_model_parallel_size or 1
    etp = ns.expert_tensor_parallel_size
    if etp is None or etp == ns.tensor_model_parallel_size:
        return ep, None
    return ep, etp


def data_parallel_size(ns: argparse.Namespace, world_size: int) -> int:
    model_parallel = (ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size
                      * ns.context_parallel_size)
    if world_size % model_parallel:
        raise PlanError(model_parallel_message(ns, world_size, model_parallel))
    return world_size // model_parallel


def model_parallel_message(ns: argparse.Namespace, world_size: int, model_parallel: int) -> str:
    """World size not divisible by tp x pp x cp: name the flag to change (one whose value does
    not divide what the others leave), the sizes that fit, and the product otherwise."""
    sizes = {"--tensor-model-parallel-size": ns.tensor_model_parallel_size,
             "--pipeline-model-parallel-size": ns.pipeline_model_parallel_size,
             "--context-parallel-size": ns.context_parallel_size}
    for flag, value in sizes.items():
        others = model_parallel // value
        if world_size % others or (world_size // others) % value == 0:
            continue
        rest = world_size // others
        fits = ", ".join(str(d) for d in range(1, rest + 1) if rest % d == 0)
        where = (f"world size {world_size}" if others == 1 else
                 f"the {rest} ranks that world size {world_size} leaves over the other parallel "
                 f"sizes ({others})")
        return f"{flag}={value} does not divide {where}; use one of {fits}, or change the ranks"
    return (f"world size {world_size} is not divisible by --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size x --context-parallel-size = {model_parallel}; "
            "change one of them or the number of ranks")


def model_from_args(ns: argparse.Namespace, *, vocab_size: int | None = None) -> ModelSpec:
    vocab = vocab_size if vocab_size is not None else ns.vocab_size
    if vocab is None:
        raise PlanError(
            "--vocab-size is missing: a plan records the tokenizer's vocabulary size (Megatron-LM "
            "reads it from the tokenizer files); add --vocab-size N"
        )
    heads = _need(ns, "num_attention_heads")
    derived: frozenset[str] = getattr(ns, "derived_args", frozenset())
    try:
        return ModelSpec(
            num_layers=_need(ns, "num_layers"), hidden_size=_need(ns, "hidden_size"),
            ffn_hidden_size=_need(ns, "ffn_hidden_size"), num_attention_heads=heads,
            num_query_groups=ns.num_query_groups if ns.group_query_attention else heads,
            vocab_size=vocab,
            kv_channels=0 if ns.kv_channels is None or "kv_channels" in derived
            else ns.kv_channels,
            tied_embeddings=not ns.untie_embeddings_and_output_weights,
            activation="swiglu" if ns.swiglu else "gelu", normalization=ns.normalization,
            position_embedding=ns.position_embedding_type,
            max_position_embeddings=_need(ns, "max_position_embeddings"),
            add_bias_linear=ns.add_bias_linear, add_qkv_bias=ns.add_qkv_bias,
            qk_layernorm=ns.qk_layernorm, norm_epsilon=ns.layernorm_epsilon,
            rotary_base=ns.rotary_base, rotary_percent=ns.rotary_percent,
            rope_scaling=ns.use_rope_scaling, rope_scaling_factor=ns.rope_scaling_factor,
            moe=moe_from_args(ns), mla=mla_from_args(ns),
        )
    except PlanError as err:
        raise PlanError(f"these Megatron flags give an invalid model: {err}") from None


def context_from_args(ns: argparse.Namespace) -> tuple[int, int]:
    """(cp, ulysses) from --context-parallel-size and --cp-comm-type (validated)."""
    total = ns.context_parallel_size
    if total == 1:
        return 1, 1
    kind = ns.cp_comm_type[0]
    if kind == "a2a":
        return 1, total
    if kind == "a2a+p2p":
        ulysses, cp = ns.hierarchical_context_parallel_sizes
        return cp, ulysses
    return total, 1


def zero_from_args(ns: argparse.Namespace) -> int:
    if ns.use_torch_fsdp2:
        return 3
    if ns.use_megatron_fsdp:
        return {"no_shard": 0, "optim": 1, "optim_grads_params": 3}[
            ns.data_parallel_sharding_strategy
        ]
    return 1 if ns.use_distributed_optimizer else 0


def recompute_from_args(ns: argparse.Namespace, stages: tuple[tuple[int, int], ...]) -> list[str]:
    """Per-layer recompute; Megatron applies --recompute-method per pipeline stage (per model
    chunk with virtual stages: each chunk is its own TransformerBlock)."""
    num_layers = stages[-1][1]
    if ns.recompute_granularity is None:
        return ["none"] * num_layers
    if ns.recompute_granularity == "selective":
        return ["selective"] * num_layers
    if ns.recompute_method == "uniform":
        return ["full"] * num_layers
    block = ns.recompute_num_layers
    return ["full" if i - start < block else "none"
            for start, end in stages for i in range(start, end)]


def virtual_stages_of(ns: argparse.Namespace, num_layers: int) -> int:
    """Model chunks per pipeline rank, as Megatron-LM's validate_args derives them
    (megatron/training/arguments.py, core_v0.16.1): from --pipeline-model-parallel-layout (its
    stage count / pp), --num-virtual-stages-per-pipeline-rank, or
    --num-layers-per-virtual-pipeline-stage (even stages only); at most one of them."""
    pp = ns.pipeline_model_parallel_size
    layout = ns.pipeline_model_parallel_layout
    per_stage = ns.num_layers_per_virtual_pipeline_stage
    per_rank = ns.num_virtual_stages_per_pipeline_rank
    given = [f for f, v in (("--num-layers-per-virtual-pipeline-stage", per_stage),
                            ("--num-virtual-stages-per-pipeline-rank", per_rank),
                            ("--pipeline-model-parallel-layout", layout)) if v is not None]
    if len(given) > 1:
        raise PlanError(f"{' and '.join(given)} cannot be set together (Megatron-LM allows at "
                        "most one); keep one")
    if layout is not None:
        return 1  # _layout_sizes counts the layout's stages itself
    if per_rank is not None:
        v = per_rank
    elif per_stage is not None:
        if (ns.decoder_first_pipeline_num_layers is not None
                or ns.decoder_last_pipeline_num_layers is not None):
            raise PlanError(
                "--num-layers-per-virtual-pipeline-stage cannot be combined with "
                "--decoder-first/last-pipeline-num-layers (Megatron-LM refuses it); use "
                "--num-virtual-stages-per-pipeline-rank for uneven interleaved pipelines"
            )
        total = (num_layers + int(ns.account_for_embedding_in_pipeline_split)
                 + int(ns.account_for_loss_in_pipeline_split))
        if total % pp or (total // pp) % per_stage:
            raise PlanError(
                f"--num-layers-per-virtual-pipeline-stage={per_stage} does not divide the "
                f"{total / pp:g} layers of each of the --pipeline-model-parallel-size={pp} "
                "stages; choose a divisor of the layers per stage"
            )
        v = total // pp // per_stage
    else:
        return 1
    return v


def _check_interleaving(ns: argparse.Namespace, pp: int, v: int) -> None:
    if v > 1 and pp == 1:
        raise PlanError("interleaved (virtual) pipeline stages need "
                        "--pipeline-model-parallel-size > 1")
    if v > 1 and pp <= 2 and not getattr(ns, "overlap_p2p_comm", True):
        raise PlanError(
            "interleaved pipelines with --no-overlap-p2p-communication need "
            "--pipeline-model-parallel-size > 2 (Megatron-LM's rule: at pp=2 batched sends and "
            "receives between the same two ranks are matched wrongly); drop "
            "--no-overlap-p2p-communication"
        )


def stage_sizes(ns: argparse.Namespace, num_layers: int) -> list[int]:
    """Transformer layers per model chunk in model order, as Megatron-LM's flags split them:
    one per pipeline stage, or pp * v with virtual stages (chunk c of rank r at c * pp + r;
    each rank's layers split evenly over its v chunks, as megatron-core's
    get_num_layers_to_build does, transformer/transformer_block.py:160-199)."""
    sizes = _stage_sizes(ns, num_layers)
    _check_interleaving(ns, ns.pipeline_model_parallel_size,
                        len(sizes) // ns.pipeline_model_parallel_size)
    return sizes


def _stage_sizes(ns: argparse.Namespace, num_layers: int) -> list[int]:
    pp = ns.pipeline_model_parallel_size
    v = virtual_stages_of(ns, num_layers)
    if ns.pipeline_model_parallel_layout is not None:
        return _layout_sizes(ns.pipeline_model_parallel_layout, pp, num_layers)
    first, last = ns.decoder_first_pipeline_num_layers, ns.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        rest, middle = num_layers - (first or 0) - (last or 0), pp - (first is not None) - (
            last is not None)
        if middle < 0 or bool(rest) != bool(middle) or (middle and rest % middle) or rest < 0:
            raise PlanError(
                f"--decoder-first/last-pipeline-num-layers ({first}, {last}) leave {rest} of "
                f"--num-layers={num_layers} for {max(middle, 0)} middle stages; they must split "
                "evenly with at least one layer each"
            )
        each = [rest // middle] * middle if middle else []
        sizes = ([first] if first is not None else []) + each + (
            [last] if last is not None else [])
        return _split_chunks(sizes, v, 0, 0)
    extra_first = int(ns.account_for_embedding_in_pipeline_split)
    extra_last = int(ns.account_for_loss_in_pipeline_split)
    total = num_layers + extra_first + extra_last
    if total % pp:
        raise PlanError(
            f"--num-layers={num_layers}"
            + (" plus the embedding/loss counted by --account-for-*" if total != num_layers else "")
            + f" is not divisible by --pipeline-model-parallel-size={pp}; use "
            "--decoder-first/last-pipeline-num-layers or --pipeline-model-parallel-layout"
        )
    return _split_chunks([total // pp] * pp, v, extra_first, extra_last)


def _split_chunks(rank_sizes: list[int], v: int, extra_first: int, extra_last: int) -> list[int]:
    """Per-chunk sizes in model order from per-rank sizes: each rank's layers over v chunks,
    then the embedding / loss counted by --account-for-* taken off the first / last chunk."""
    pp = len(rank_sizes)
    bad = [n for n in rank_sizes if n % v]
    if bad:
        raise PlanError(
            f"a pipeline stage of {bad[0]} layers does not split into {v} virtual stages "
            "(megatron-core splits each stage's layers evenly over its chunks); change the "
            "stage sizes or the virtual pipeline size"
        )
    sizes = [rank_sizes[j % pp] // v for j in range(pp * v)]
    sizes[0] -= extra_first
    sizes[-1] -= extra_last
    if min(sizes) < 1:
        what = "stage" if v == 1 else "virtual stage"
        raise PlanError(
            f"--account-for-*-in-pipeline-split leaves a pipeline {what} with no transformer "
            f"layer (sizes {sizes}); megatron_ext needs at least one layer per {what}"
        )
    return sizes


def parse_layout(text: str) -> list[list[str]]:
    """Mirror of PipelineParallelLayerLayout.parse_str_to_list (megatron-core 0.16.1,
    transformer/pipeline_parallel_layer_layout.py:283): drop commas, unroll `(..)*n` then
    `x*n`, split stages at `|`. Kept here so the CLI need not import megatron."""
    text = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        grown = sum(len(m.group(1)) * int(m.group(2)) for m in re.finditer(pattern, text))
        if grown > _MAX_LAYOUT_CHARS:
            raise ValueError(f"layout expands to more than {_MAX_LAYOUT_CHARS} characters")
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return [list(stage) for stage in text.split("|")]


def _layout_sizes(text: str, pp: int, num_layers: int) -> list[int]:
    flag = f"--pipeline-model-parallel-layout {text!r}"
    try:
        stages = parse_layout(text)
    except ValueError as err:
        raise PlanError(f"{flag}: {err}; write the repeats out") from None
    bad = sorted({c for stage in stages for c in stage} - {"E", "L", "t", "m"})
    if bad:
        raise PlanError(f"{flag} has unknown layer characters {bad}; use E, t, L and |")
    if any("m" in stage for stage in stages):
        raise PlanError(f"{flag} has MTP layers (m), which megatron_ext does not support yet")
    if len(stages) % pp:
        raise PlanError(
            f"{flag} describes {len(stages)} stages for --pipeline-model-parallel-size={pp}; "
            "give a multiple of pp stages (pp * virtual stages, Megatron-LM's rule)"
        )
    flat = [c for stage in stages for c in stage]
    if flat.count("E") != 1 or flat[0] != "E" or flat.count("L") != 1 or flat[-1] != "L":
        raise PlanError(f"{flag} must start with E (embedding) and end with L (loss), once each")
    sizes = [stage.count("t") for stage in stages]
    if sum(sizes) != num_layers:
        raise PlanError(f"{flag} has {sum(sizes)} layers (t) but --num-layers={num_layers}")
    if min(sizes) < 1:
        raise PlanError(
            f"{flag} gives stage {sizes.index(0)} no transformer layer; megatron_ext needs at "
            "least one layer per stage"
        )
    return sizes


def apply_strategy_config(ns: argparse.Namespace, defaults: argparse.ArgumentParser, *,
                          world_size: int | None) -> None:
    """Check the given flags against the --strategy-config plan and fill in the rest.

    `defaults` is the parser that read `ns` (its defaults stand for flags not given).
    Values the plan varies per layer become None so no code mistakes a Megatron default for them.
    The loaded plan is kept as `ns.strategy_plan`, so the file is read once per parse.
    """
    path = ns.strategy_config
    plan = _load_plan(path)
    ns.strategy_plan = plan
    if world_size is not None:
        _check_world(plan, world_size, path)
    view = megatron_values(plan).values
    for dest in sorted(_CHECKED_DESTS & ns.explicit_args):
        want = view[dest] if view[dest] is not None else defaults.get_default(dest)
        flag = FLAG_OF_DEST[dest]
        if want is PLAN_ONLY:
            raise PlanError(
                f"{flag} conflicts with --strategy-config {path}: the plan sets it per layer; "
                f"drop {flag}"
            )
        if getattr(ns, dest) != want:
            raise PlanError(
                f"{flag}={_show(getattr(ns, dest))} conflicts with --strategy-config {path}, "
                f"whose plan gives {_show(want)}; drop the flag or fix the plan"
            )
    for dest, value in view.items():
        if dest not in ns.explicit_args and value is not None:
            setattr(ns, dest, None if value is PLAN_ONLY else value)
    _check_model(ns, plan, path)


def _check_model(ns: argparse.Namespace, plan: ParallelPlan, path: str) -> None:
    model = model_from_args(ns)
    for field, flag in _MODEL_FLAG.items():
        given, want = getattr(model, field), getattr(plan.model, field)
        if given != want:
            raise PlanError(
                f"{flag} conflicts with --strategy-config {path}: the flags give model."
                f"{field}={given!r}, the plan {want!r}; drop the flag or fix the plan"
            )
    given_moe, want_moe = model.moe, plan.model.moe
    if (given_moe is None) != (want_moe is None):
        raise PlanError(
            f"--num-experts conflicts with --strategy-config {path}: the flags give "
            f"{'no ' if given_moe is None else ''}experts, the plan "
            f"{'none' if want_moe is None else want_moe.num_experts}; drop the flag or fix the "
            "plan")
    if given_moe is not None and want_moe is not None and given_moe != want_moe:
        field = next(f for f in _SPEC_FLAG if getattr(given_moe, f) != getattr(want_moe, f))
        raise PlanError(
            f"{_SPEC_FLAG[field]} conflicts with --strategy-config {path}: the flags give "
            f"model.moe.{field}={getattr(given_moe, field)!r}, the plan "
            f"{getattr(want_moe, field)!r}; drop the flag or fix the plan")
    mla_flag = mla_mismatch(model.mla, plan.model.mla)
    if mla_flag is not None:
        raise PlanError(
            f"{mla_flag} conflicts with --strategy-config {path}: the flags give model.mla="
            f"{model.mla!r}, the plan {plan.model.mla!r}; drop the flag or fix the plan")
    _check_expert_degrees(ns, plan, path)


def _check_expert_degrees(ns: argparse.Namespace, plan: ParallelPlan, path: str) -> None:
    """Explicit --expert-model/tensor-parallel-size must match every MoE layer of the plan."""
    moe_layers = [s for i, s in enumerate(plan.layers) if plan.model.is_moe_layer(i)]
    for dest, flag, attr in (("expert_model_parallel_size", "--expert-model-parallel-size", "ep"),
                             ("expert_tensor_parallel_size", "--expert-tensor-parallel-size",
                              "expert_tp")):
        if dest not in ns.explicit_args:
            continue
        values = sorted({getattr(s, attr) for s in moe_layers})
        if not moe_layers and getattr(ns, dest) in (1, None):
            continue
        if values != [getattr(ns, dest)]:
            raise PlanError(
                f"{flag}={getattr(ns, dest)} conflicts with --strategy-config {path}, whose MoE "
                f"layers have {attr}={', '.join(map(str, values)) or 'none (no MoE layer)'}; "
                "drop the flag or fix the plan")


def _load_plan(path: str) -> ParallelPlan:
    try:
        return ParallelPlan.load(path)
    except PlanError as err:
        text = str(err)
        raise PlanError(text if path in text else f"--strategy-config {path}: {text}") from None


def _check_world(plan: ParallelPlan, world_size: int, path: str) -> None:
    if plan.world_size != world_size:
        raise PlanError(
            f"--strategy-config {path} is a plan for world_size={plan.world_size} but this job "
            f"has {world_size} ranks; search a plan for {world_size} ranks"
        )


def _need(ns: argparse.Namespace, dest: str) -> Any:
    value = getattr(ns, dest)
    if value is None:
        flag = "--" + dest.replace("_", "-")
        raise PlanError(f"{flag} is missing; Megatron-LM requires it")
    return value


def _show(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)
