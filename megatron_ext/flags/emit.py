"""Plan -> Megatron-LM command-line flags (`megatron-ext args PLAN.json`).

`megatron_values(plan)` maps a plan onto Megatron-LM's argument namespace (dest -> value);
`plan_to_megatron_args` renders it as argv tokens, one per printed line. A value that differs
between layers, or that Megatron-LM cannot express, is `PLAN_ONLY`: the command line then carries
the common flags plus `--strategy-config PLAN.json`, which only megatron_ext's pretrain_gpt.py
reads. The reverse direction is flags/to_plan.py; both share flags.table.EMIT_TABLE.

Mapping decisions (Megatron-LM core_v0.16.1 semantics):
- micro_batch_size: the plan counts samples over all data-parallel replicas, Megatron per
  replica, so `--micro-batch-size` = plan.micro_batch_size / dp.
- ulysses: Megatron-LM's all-to-all context parallelism is DeepSpeed-Ulysses, so ulysses=U, cp=1
  is `--context-parallel-size U --cp-comm-type a2a`; cp=C and ulysses=U is
  `--context-parallel-size C*U --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes U C`
  (a2a inside groups of U ranks, ring p2p across them). Megatron-LM needs transformer-engine
  for any context parallelism.
- zero: 1 is `--use-distributed-optimizer`; 2 needs --strategy-config (Megatron-LM's only
  ZeRO-2 is Megatron-FSDP `optim_grads`, which megatron_ext does not run); 3 is
  `--use-torch-fsdp2` (plus `--no-gradient-accumulation-fusion`). Megatron-LM allows FSDP2
  only with pp=1 (validate_args); megatron_ext's stock FSDP2 path also needs untied embeddings
  and no fp16 (flags/checks.py); other zero=3 plans need --strategy-config.
- recompute: selective is `--recompute-granularity selective` (core attention, Megatron's
  default module); full in every layer is `full` + `--recompute-method uniform
  --recompute-num-layers 1`; full in the first k layers of every stage (fewer if the stage is
  shorter) and none after is `--recompute-method block --recompute-num-layers k`.
- stages: even splits need no flag; [f, m, ..., m, l] uses
  `--decoder-first/last-pipeline-num-layers`; anything else `--pipeline-model-parallel-layout`
  such as `Et*3|tL`. Interleaved plans (virtual_stages > 1) with every chunk the same size use
  `--num-layers-per-virtual-pipeline-stage`, other chunk sizes the layout string with pp * v
  stages (`Et*2|t*2|t|t*3L`: chunk c of rank r is stage c * pp + r, as in the plan).
- MoE: model.moe is `--num-experts` and the `--moe-*` flags of flags/moe.py (defaults left
  out, except --moe-router-topk, --moe-router-load-balancing-type and --moe-aux-loss-coeff,
  which Megatron-LM's recipes spell out). Dense layers carry no expert degrees; when every MoE
  layer has the same ep and etp the plan is uniform in Megatron-LM's sense and they are
  `--expert-model-parallel-size` / `--expert-tensor-parallel-size` (the latter only when it
  differs from tp, Megatron-LM's default). The dispatcher and grouped GEMM are training flags,
  not plan fields: add `--moe-token-dispatcher-type alltoall` / `--moe-grouped-gemm` yourself.
- overlap: plan.overlap_grad_reduce / overlap_param_gather are `--overlap-grad-reduce` /
  `--overlap-param-gather` (`search` turns both on where Megatron-LM allows them: param gather
  only with a distributed optimizer, i.e. a ZeRO-1 layer); plan.tp_comm_overlap is
  `--tp-comm-overlap` (never set by `search`: the training runtime refuses it).
- vocab_size is printed as `--vocab-size`; Megatron-LM reads it only with NullTokenizer, other
  tokenizers take the size from their files.
- version: `megatron_version` picks the Megatron-LM flag catalog (flags/versions.py; None: the
  installed megatron-core's, else the newest). Every Megatron flag printed is one that version
  has; one it lacks is a one-line PlanError naming the version and the replacement. (The flags
  emitted here are the same in core_v0.16.1 and core_v0.19.0, with the same defaults: a test
  keeps it so.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_ext.errors import PlanError
from megatron_ext.flags.catalog import option_sets
from megatron_ext.flags.fp8 import fp8_values
from megatron_ext.flags.mla import mla_values
from megatron_ext.flags.moe import layer_freq_text, moe_values
from megatron_ext.flags.table import EMIT_TABLE
from megatron_ext.flags.versions import FlagCatalogVersion, resolve, wrong_version_message
from megatron_ext.plan import ParallelPlan


class _PlanOnly:
    """Sentinel: this Megatron value is carried by the plan file only (per layer or no flag)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PLAN_ONLY"


PLAN_ONLY: Any = _PlanOnly()


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronArgs:
    """A plan as Megatron-LM argv tokens."""

    argv: tuple[str, ...]
    """Tokens in order; print one per line for `mapfile -t`."""
    needs_megatron_ext: tuple[str, ...]
    """Plan features plain Megatron-LM cannot run (empty: a stock pretrain_gpt.py can)."""

    @property
    def uses_strategy_config(self) -> bool:
        return "--strategy-config" in self.argv


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronView:
    """A plan seen as Megatron-LM's argument namespace."""

    values: dict[str, Any]
    """dest -> value; None means "flag absent", PLAN_ONLY "only the plan file can say"."""
    reasons: tuple[str, ...]
    """Why --strategy-config is needed; empty when every value has a Megatron flag."""


def megatron_values(plan: ParallelPlan) -> MegatronView:
    reasons: list[str] = []
    values: dict[str, Any] = {}
    values.update(_model_values(plan))
    values.update(_layer_values(plan, reasons))
    values.update(_stage_values(plan))
    values["micro_batch_size"] = (
        PLAN_ONLY if values["_dp"] is PLAN_ONLY else plan.micro_batch_size // values["_dp"]
    )
    del values["_dp"]
    values["global_batch_size"] = plan.global_batch_size
    values["seq_length"] = plan.seq_length
    values["bf16"] = plan.precision == "bf16"
    values["fp16"] = plan.precision == "fp16"
    values.update(fp8_values(plan.fp8))
    if plan.fp8 is not None and plan.fp8.bf16_layers:
        reasons.append(f"layers kept in bf16 in an FP8 run (fp8.bf16_layers "
                       f"{list(plan.fp8.bf16_layers)})")
    values.update(_ext_values(plan, values["tensor_model_parallel_size"], reasons))
    values["overlap_grad_reduce"] = plan.overlap_grad_reduce
    values["overlap_param_gather"] = plan.overlap_param_gather
    values["tp_comm_overlap"] = plan.tp_comm_overlap
    values["strategy_config"] = None
    return MegatronView(values=values, reasons=tuple(reasons))


def plan_to_megatron_args(plan: ParallelPlan, *, plan_path: str | None = None,
                          megatron_version: str | None = None) -> MegatronArgs:
    """Megatron-LM flags for `plan`; `plan_path` is printed after --strategy-config if needed.
    (Building `plan` ran plan_checks.check_plan, Megatron-LM's own rules on its fields included.)"""
    version = resolve(megatron_version)
    view = megatron_values(plan)
    values = {k: v for k, v in view.values.items() if v is not PLAN_ONLY}
    if view.reasons:
        if plan_path is None:
            raise PlanError("this plan needs --strategy-config PLAN.json; pass the plan's path")
        if "\n" in plan_path:
            raise PlanError(f"plan path {plan_path!r} contains a newline; rename the file")
        values["strategy_config"] = plan_path
    needs = list(view.reasons)
    if plan.vocab.mode == "vocab_parallel" and not view.reasons:
        needs.append("vocabulary parallelism (--vocab-parallel)")
    if plan.flexsp is not None and not view.reasons:
        needs.append("flexible sequence parallelism (--flexsp)")
    argv = render_argv(values)
    check_emitted(argv, version)
    return MegatronArgs(argv=tuple(argv), needs_megatron_ext=tuple(needs))


MEGATRON_EXT_FLAGS = frozenset(flag for _, _, flag, _ in EMIT_TABLE) - frozenset().union(
    *option_sets().values())
"""Flags of EMIT_TABLE that are megatron_ext's own (--strategy-config, --vocab-parallel, ...)."""


def check_emitted(argv: list[str], version: FlagCatalogVersion) -> None:
    """Every Megatron flag in `argv` exists in `version`'s catalog, or a one-line PlanError."""
    mine = option_sets()[version.version]
    others = {v: options for v, options in option_sets().items() if v != version.version}
    for token in argv:
        if token.startswith("--") and token not in mine and token not in MEGATRON_EXT_FLAGS:
            message = wrong_version_message(token, version, others)
            raise PlanError(message or f"{token} is not a Megatron-LM {version.tag} flag")


def render_argv(values: dict[str, Any]) -> list[str]:
    """argv tokens for a dest -> value mapping, in EMIT_TABLE order."""
    argv: list[str] = []
    for _, dest, flag, kind in EMIT_TABLE:
        value = values.get(dest)
        if value is None or value is PLAN_ONLY:
            continue
        if kind == "value":
            argv += [flag, str(value)]
        elif kind == "freq":
            argv += [flag, layer_freq_text(value)]
        elif kind == "list":
            argv += [flag, *(str(v) for v in value)]
        elif (kind == "true") == bool(value):
            argv.append(flag)
    return argv


def _model_values(plan: ParallelPlan) -> dict[str, Any]:
    m = plan.model
    gqa = m.num_query_groups != m.num_attention_heads
    return {
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "ffn_hidden_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "group_query_attention": gqa,
        "num_query_groups": m.num_query_groups if gqa else None,
        "kv_channels": m.kv_channels or None,
        "max_position_embeddings": m.max_position_embeddings,
        "position_embedding_type": m.position_embedding,
        "normalization": m.normalization,
        "swiglu": m.activation == "swiglu",
        "untie_embeddings_and_output_weights": not m.tied_embeddings,
        "add_bias_linear": m.add_bias_linear,
        "add_qkv_bias": m.add_qkv_bias,
        "qk_layernorm": m.qk_layernorm,
        # printed only where they differ from Megatron-LM's defaults, to keep the lines short
        "layernorm_epsilon": _unless(m.norm_epsilon, 1e-5),
        "rotary_base": _unless(m.rotary_base, 10000),
        "rotary_percent": _unless(m.rotary_percent, 1.0),
        "use_rope_scaling": m.rope_scaling,
        "rope_scaling_factor": _unless(m.rope_scaling_factor, 8.0),
        "vocab_size": m.vocab_size,
        **moe_values(m.moe),
        **mla_values(m.mla),
    }


def _unless(value: Any, default: Any) -> Any:
    return None if value == default else value


def _uniform(plan: ParallelPlan, attr: str, reasons: list[str]) -> Any:
    """The layers' common value of `attr`, or PLAN_ONLY plus a reason when it varies."""
    seen = list(dict.fromkeys(getattr(s, attr) for s in plan.layers))
    if len(seen) == 1:
        return seen[0]
    reasons.append(f"per-layer {attr} ({', '.join(str(v) for v in seen)})")
    return PLAN_ONLY


def _layer_values(plan: ParallelPlan, reasons: list[str]) -> dict[str, Any]:
    tp, sp, dp = (_uniform(plan, a, reasons) for a in ("tp", "sp", "dp"))
    cp, ulysses, zero = (_uniform(plan, a, reasons) for a in ("cp", "ulysses", "zero"))
    values: dict[str, Any] = {
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": plan.pp,
        "sequence_parallel": sp, "_dp": dp,
    }
    values.update(_expert_values(plan, tp, reasons))
    values.update(_context_values(plan, cp, ulysses, reasons))
    values.update(_zero_values(plan, zero, reasons))
    values.update(_recompute_values(plan, reasons))
    return values


def _expert_values(plan: ParallelPlan, tp: Any, reasons: list[str]) -> dict[str, Any]:
    """--expert-model/tensor-parallel-size: Megatron-LM gives every MoE layer the same ep and
    etp (dense layers have none), so a plan whose MoE layers agree on them is uniform here."""
    moe = [s for i, s in enumerate(plan.layers) if plan.model.is_moe_layer(i)]
    keys = ("expert_model_parallel_size", "expert_tensor_parallel_size")
    if not moe:
        return dict.fromkeys(keys)
    eps = list(dict.fromkeys(s.ep for s in moe))
    etps = list(dict.fromkeys(s.expert_tp for s in moe))
    if len(eps) > 1 or len(etps) > 1:
        reasons.append("per-layer expert degrees (ep " + ", ".join(map(str, eps)) + "; etp "
                       + ", ".join(map(str, etps)) + ")")
        return dict.fromkeys(keys, PLAN_ONLY)
    etp = None if tp is PLAN_ONLY or etps[0] == tp else etps[0]
    if tp is PLAN_ONLY and any(s.etp is not None for s in moe):
        etp = etps[0]  # the dense layers' tp varies: print the experts' own degree
    return dict(zip(keys, (_unless(eps[0], 1), etp)))


def _context_values(plan: ParallelPlan, cp: Any, uly: Any, reasons: list[str]) -> dict[str, Any]:
    keys = ("context_parallel_size", "cp_comm_type", "hierarchical_context_parallel_sizes")
    if cp is PLAN_ONLY or uly is PLAN_ONLY:
        return dict.fromkeys(keys, PLAN_ONLY)
    if uly > 1 and plan.seq_length % (2 * cp * uly):
        reasons.append(
            f"ulysses={uly} with seq_length={plan.seq_length} (Megatron-LM's context parallelism "
            f"needs seq_length divisible by 2*cp*ulysses={2 * cp * uly})"
        )
        return dict.fromkeys(keys, PLAN_ONLY)
    if uly == 1:
        return dict(zip(keys, (cp, None, None)))
    if cp == 1:
        return dict(zip(keys, (uly, ["a2a"], None)))
    return dict(zip(keys, (cp * uly, ["a2a+p2p"], [uly, cp])))


def _zero_values(plan: ParallelPlan, zero: Any, reasons: list[str]) -> dict[str, Any]:
    keys = ("use_distributed_optimizer", "use_torch_fsdp2", "gradient_accumulation_fusion")
    if zero is PLAN_ONLY:
        return dict.fromkeys(keys, PLAN_ONLY)
    if zero == 2:  # Megatron-LM's ZeRO-2 is Megatron-FSDP optim_grads, which we do not emit
        reasons.append("zero=2 (Megatron-LM has ZeRO-2 only as Megatron-FSDP's optim_grads, "
                       "a different implementation from the layerwise runtime's FSDP2)")
        return dict.fromkeys(keys, PLAN_ONLY)
    if zero == 3:
        limits = [
            text for bad, text in (
                (plan.pp > 1, f"pp={plan.pp}"),
                (plan.model.tied_embeddings, "tied embeddings"),
                (plan.precision == "fp16", "fp16"),
            ) if bad
        ]
        if limits:
            reasons.append(
                f"zero=3 with {', '.join(limits)} (--use-torch-fsdp2 needs pp=1 in Megatron-LM, "
                "and untied embeddings and no fp16 in megatron_ext)"
            )
            return dict.fromkeys(keys, PLAN_ONLY)
        return dict(zip(keys, (False, True, False)))
    return dict(zip(keys, (zero == 1, False, True)))


def _recompute_values(plan: ParallelPlan, reasons: list[str]) -> dict[str, Any]:
    keys = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    kinds = {s.recompute for s in plan.layers}
    if kinds == {"none"}:
        return dict.fromkeys(keys)
    if kinds == {"selective"}:
        return dict(zip(keys, ("selective", None, None)))
    if kinds == {"full"}:
        return dict(zip(keys, ("full", "uniform", 1)))
    block = _recompute_block_size(plan) if kinds == {"full", "none"} else None
    if block is None:
        kinds_per_layer = [layer.recompute for layer in plan.layers]
        runs = [f"[{s}, {e}) {kind}" for s, e, kind in _runs(kinds_per_layer)]
        reasons.append(
            f"per-layer recompute ({'; '.join(runs)}) beyond Megatron-LM's "
            "--recompute-method block (full in the first k layers of every stage)"
        )
        return dict.fromkeys(keys, PLAN_ONLY)
    return dict(zip(keys, ("full", "block", block)))


def _runs(values: list[Any]) -> list[tuple[int, int, Any]]:
    """Maximal runs [start, end) of equal consecutive values."""
    runs: list[tuple[int, int, Any]] = []
    for i, value in enumerate(values):
        if runs and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], i + 1, value)
        else:
            runs.append((i, i + 1, value))
    return runs


def _recompute_block_size(plan: ParallelPlan) -> int | None:
    """k such that each stage recomputes exactly its first min(k, len) layers, else None."""
    prefixes = []
    for start, end in plan.stages:
        full = [plan.layers[i].recompute == "full" for i in range(start, end)]
        k = full.index(False) if False in full else len(full)
        if any(full[k:]):
            return None
        prefixes.append((k, end - start))
    block = max(k for k, _ in prefixes)
    return block if all(k == min(block, n) for k, n in prefixes) else None


def _stage_values(plan: ParallelPlan) -> dict[str, Any]:
    sizes = [end - start for start, end in plan.stages]
    values: dict[str, Any] = dict.fromkeys(
        ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
         "pipeline_model_parallel_layout", "num_layers_per_virtual_pipeline_stage")
    )
    if plan.virtual_stages > 1:
        if len(set(sizes)) == 1:
            values["num_layers_per_virtual_pipeline_stage"] = sizes[0]
        else:
            values["pipeline_model_parallel_layout"] = layout_string(sizes)
        return values
    if len(set(sizes)) == 1:
        return values
    first, *middle, last = sizes
    if not middle:
        values["decoder_first_pipeline_num_layers"] = first
    elif len(set(middle)) == 1:
        if first != middle[0]:
            values["decoder_first_pipeline_num_layers"] = first
        if last != middle[0]:
            values["decoder_last_pipeline_num_layers"] = last
    else:
        values["pipeline_model_parallel_layout"] = layout_string(sizes)
    return values


def layout_string(sizes: list[int]) -> str:
    """Megatron's --pipeline-model-parallel-layout for stages of `sizes` layers: `Et*3|tL`."""
    stages = ["t" if n == 1 else f"t*{n}" for n in sizes]
    return "E" + "|".join(stages) + "L"


def _ext_values(plan: ParallelPlan, tp: Any, reasons: list[str]) -> dict[str, Any]:
    vocab = plan.vocab
    if tp is not PLAN_ONLY and vocab.tp != tp:
        reasons.append(f"vocab.tp={vocab.tp} differs from the layers' tp={tp}")
    parallel = vocab.mode == "vocab_parallel"
    flexsp = plan.flexsp
    return {
        "vocab_parallel": parallel,
        "vocab_parallel_algorithm": vocab.algorithm if parallel else None,
        "flexsp": flexsp is not None,
        "flexsp_max_group_size": flexsp.max_group_size if flexsp else None,
        "flexsp_min_group_size": flexsp.min_group_size if flexsp else None,
        "attention_dropout": 0.0 if flexsp else None,  # FlexSP attention has no dropout
    }
