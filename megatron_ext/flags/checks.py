"""Cross-flag rules of Megatron-LM's `validate_args` (megatron/training/arguments.py,
core_v0.16.1) and `TransformerConfig.__post_init__`, plus megatron_ext's own limits.

Each failed rule is a one-line PlanError naming the flags. Derived defaults are filled in as
Megatron-LM fills them (ffn_hidden_size, kv_channels, global_batch_size) and listed in
`ns.derived_args`. Where Megatron-LM silently ignores a flag, megatron_ext ignores it too and
says so (--recompute-method without --recompute-granularity) or refuses it (--num-query-groups
without --group-query-attention); where Megatron-LM warns and corrects (--sequence-parallel at
tp=1) it does the same.
"""

from __future__ import annotations

import argparse
import logging

from megatron_ext.errors import PlanError
from megatron_ext.flags.mla import check_mla_args
from megatron_ext.flags.moe import check_moe_args
from megatron_ext.flags.to_plan import data_parallel_size, stage_sizes
from megatron_ext.plan_checks import check_sequence

logger = logging.getLogger(__name__)

SUPPORTED_TOKENIZERS = (None, "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


def apply_aliases(ns: argparse.Namespace) -> None:
    """Megatron-LM's deprecated spellings, resolved before anything reads the namespace."""
    explicit = set(ns.explicit_args)
    if ns.use_rotary_position_embeddings:
        ns.position_embedding_type = "rope"
        explicit.add("position_embedding_type")
    if ns.recompute_activations:
        ns.recompute_granularity = "selective"
        explicit.add("recompute_granularity")
    ns.explicit_args = frozenset(explicit)


def validate_megatron_args(
    ns: argparse.Namespace, *, world_size: int | None, model_only: bool = False
) -> None:
    apply_aliases(ns)
    derived: set[str] = set()
    required = ["num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"]
    if not model_only:
        required += ["seq_length"] + ([] if ns.strategy_config else ["micro_batch_size"])
    for dest in required:
        if getattr(ns, dest) is None:
            raise PlanError(f"--{dest.replace('_', '-')} is missing; Megatron-LM requires it")
    _check_model(ns, derived)
    check_moe_args(ns, derived)
    check_mla_args(ns)
    _check_pipeline(ns)
    _check_context(ns)
    _check_recompute(ns)
    _check_data_parallel(ns)
    _check_training(ns)
    _check_megatron_ext(ns)
    degrees = (ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size,
               ns.context_parallel_size)
    if world_size is not None and None not in degrees:  # None: varies per layer in the plan
        _check_world(ns, world_size, derived)
    if ns.tensor_model_parallel_size == 1 and ns.sequence_parallel:
        logger.warning("disabling --sequence-parallel because --tensor-model-parallel-size is 1, "
                       "as Megatron-LM does")
        ns.sequence_parallel = False
    if ns.tp_comm_overlap and ns.sequence_parallel is False:  # None: per layer in the plan
        raise PlanError("--tp-comm-overlap needs --sequence-parallel (Megatron-LM requires it, "
                        "and turns sequence parallelism off at --tensor-model-parallel-size 1); "
                        "add --sequence-parallel with tp > 1 or drop --tp-comm-overlap")
    ns.derived_args = frozenset(derived)


def _check_model(ns: argparse.Namespace, derived: set[str]) -> None:
    heads = ns.num_attention_heads
    if "num_query_groups" in ns.explicit_args and not ns.group_query_attention:
        raise PlanError("--num-query-groups has no effect without --group-query-attention; add it")
    if ns.group_query_attention and heads % ns.num_query_groups:
        raise PlanError(
            f"--num-query-groups={ns.num_query_groups} does not divide --num-attention-heads="
            f"{heads}"
        )
    if ns.ffn_hidden_size is None:
        h = ns.hidden_size
        ns.ffn_hidden_size = int((4 * h * 2 / 3) / 64) * 64 if ns.swiglu else 4 * h
        derived.add("ffn_hidden_size")
        if ns.ffn_hidden_size < 1:
            raise PlanError(
                f"--ffn-hidden-size defaults to 0 for --hidden-size={h} with --swiglu; give it"
            )
    if ns.kv_channels is None:
        if ns.hidden_size % heads:
            raise PlanError(
                f"--hidden-size={ns.hidden_size} is not divisible by --num-attention-heads="
                f"{heads}; give --kv-channels"
            )
        ns.kv_channels = ns.hidden_size // heads
        derived.add("kv_channels")
    if not ns.add_position_embedding and ns.position_embedding_type != "rope":
        raise PlanError("--no-position-embedding is deprecated, use --position-embedding-type "
                        "(Megatron-LM accepts it only with rope)")
    if ns.apply_query_key_layer_scaling:  # Megatron-LM's validate_args does the same
        ns.attention_softmax_in_fp32 = True
    if ns.position_embedding_type not in ("rope", "learned_absolute"):
        raise PlanError(
            f"--position-embedding-type {ns.position_embedding_type} is a Megatron setting "
            "megatron_ext does not support yet; use rope or learned_absolute"
        )
    if ns.seq_length is not None:
        check_sequence(
            ns.seq_length,
            ns.max_position_embeddings,
            seq_name="--seq-length",
            max_name="--max-position-embeddings",
        )


def _check_pipeline(ns: argparse.Namespace) -> None:
    uneven = (ns.decoder_first_pipeline_num_layers is not None
              or ns.decoder_last_pipeline_num_layers is not None)
    account = ns.account_for_embedding_in_pipeline_split or ns.account_for_loss_in_pipeline_split
    if ns.pipeline_model_parallel_layout is not None and (uneven or account):
        raise PlanError(
            "--pipeline-model-parallel-layout cannot be combined with "
            "--decoder-first/last-pipeline-num-layers or --account-for-*-in-pipeline-split"
        )
    if uneven and account:
        raise PlanError(
            "--decoder-first/last-pipeline-num-layers cannot be combined with "
            "--account-for-embedding/loss-in-pipeline-split"
        )
    if ns.pipeline_model_parallel_size is not None:
        stage_sizes(ns, ns.num_layers)


def _check_context(ns: argparse.Namespace) -> None:
    kinds = ns.cp_comm_type or ["p2p"]
    for kind in kinds:
        if kind not in CP_COMM_TYPES:
            raise PlanError(f"--cp-comm-type {kind} must be one of {', '.join(CP_COMM_TYPES)}")
    if len(kinds) > 1:
        raise PlanError(
            "per-layer --cp-comm-type is not supported yet; give one type (per-layer layouts go "
            "in a --strategy-config plan)"
        )
    cp, sizes = ns.context_parallel_size, ns.hierarchical_context_parallel_sizes
    if cp is None:
        return
    if sizes is not None and _product(sizes) != cp:
        raise PlanError(
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} must multiply "
            f"to --context-parallel-size={cp}"
        )
    if kinds[0] == "a2a+p2p" and (sizes is None or len(sizes) != 2):
        raise PlanError(
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes ULYSSES CP "
            "(two levels: all-to-all inside, ring across)"
        )
    if cp > 1 and kinds[0] == "allgather":
        raise PlanError(
            "--cp-comm-type allgather is a Megatron setting megatron_ext does not support yet; "
            "use p2p (ring) or a2a (Ulysses)"
        )
    if cp > 1 and ns.seq_length is not None and ns.seq_length % (2 * cp):
        raise PlanError(
            f"--seq-length={ns.seq_length} must be a multiple of 2 x --context-parallel-size="
            f"{2 * cp} (Megatron-LM requires it)"
        )


def _check_recompute(ns: argparse.Namespace) -> None:
    granularity, method, count = (ns.recompute_granularity, ns.recompute_method,
                                  ns.recompute_num_layers)
    if granularity is None and (method is not None or count is not None):
        # Megatron-LM's validate_args and TransformerConfig only read them under full recompute
        logger.warning("--recompute-method/--recompute-num-layers are ignored without "
                       "--recompute-granularity full, as Megatron-LM ignores them")
        ns.recompute_method = ns.recompute_num_layers = None
        return
    if granularity == "selective" and (method is not None or count is not None):
        raise PlanError(
            "--recompute-granularity selective takes no --recompute-method or "
            "--recompute-num-layers (Megatron-LM rejects them)"
        )
    if granularity == "full" and (method is None or count is None):
        raise PlanError(
            "--recompute-granularity full needs --recompute-method (uniform or block) and "
            "--recompute-num-layers"
        )
    if ns.recompute_modules is not None and ns.recompute_modules != ["core_attn"]:
        raise PlanError(
            f"--recompute-modules {' '.join(ns.recompute_modules)} is not supported yet; "
            "megatron_ext's selective recompute covers core_attn only"
        )


def _check_data_parallel(ns: argparse.Namespace) -> None:
    if ns.use_torch_fsdp2 and ns.use_megatron_fsdp:
        raise PlanError("--use-torch-fsdp2 and --use-megatron-fsdp exclude each other; pick one")
    if ns.use_torch_fsdp2:
        rules = (
            (ns.pipeline_model_parallel_size not in (1, None), "--pipeline-model-parallel-size 1"),
            (ns.use_distributed_optimizer, "no --use-distributed-optimizer"),
            (not ns.untie_embeddings_and_output_weights, "--untie-embeddings-and-output-weights"),
            (ns.fp16, "no --fp16"),
            (ns.gradient_accumulation_fusion, "--no-gradient-accumulation-fusion"),
            (ns.ckpt_format not in ("torch_dist", "torch_dcp"), "--ckpt-format torch_dist"),
        )
        for index, (broken, need) in enumerate(rules):
            if broken:  # Megatron-LM itself asks only for pp=1 (validate_args); the rest are
                # limits of megatron_ext's FSDP2 path
                who = "Megatron-LM requires it" if index == 0 else "a limit of megatron_ext's FSDP2"
                raise PlanError(f"--use-torch-fsdp2 needs {need} ({who})")
    if ns.use_megatron_fsdp:
        if ns.data_parallel_sharding_strategy == "optim_grads":
            raise PlanError(
                "--data-parallel-sharding-strategy optim_grads (ZeRO-2) is not supported yet; "
                "use optim (zero=1) or optim_grads_params (zero=3)"
            )
        if ns.ckpt_format != "fsdp_dtensor":
            raise PlanError("--use-megatron-fsdp needs --ckpt-format fsdp_dtensor "
                            "(Megatron-LM requires it)")
    strategy_plan = getattr(ns, "strategy_plan", None)  # per-layer ZeRO: its ZeRO-1 layers
    sharded = strategy_plan is not None and any(s.zero == 1 for s in strategy_plan.layers)
    if ns.overlap_param_gather and not (ns.use_distributed_optimizer or ns.use_megatron_fsdp
                                        or sharded):
        raise PlanError("--overlap-param-gather needs --use-distributed-optimizer")
    if ns.overlap_param_gather and not ns.overlap_grad_reduce:
        raise PlanError("--overlap-param-gather needs --overlap-grad-reduce")
    if ns.num_distributed_optimizer_instances != 1:
        raise PlanError("--num-distributed-optimizer-instances other than 1 is a Megatron "
                        "setting megatron_ext does not support yet")
    if ns.fp16 and ns.bf16:
        raise PlanError("--fp16 and --bf16 exclude each other; pick one")
    if ns.fp16 and not ns.loss_scale:
        # Megatron-LM's validate_args: under dynamic loss scaling a NaN/Inf gradient is the loss
        # scaler's signal (skip the step, lower the scale), not an error
        ns.check_for_nan_in_loss_and_grad = False


def _check_training(ns: argparse.Namespace) -> None:
    if ns.lr is not None and ns.min_lr > ns.lr:
        raise PlanError(f"--min-lr={ns.min_lr} exceeds --lr={ns.lr}")
    if ns.save is not None and (ns.save_interval is None or ns.save_interval < 1):
        raise PlanError("--save needs a positive --save-interval (Megatron-LM requires it)")
    if ns.async_save and ns.ckpt_format != "torch_dist":  # Megatron-LM's save_checkpoint
        raise PlanError(f"--async-save is not implemented for --ckpt-format {ns.ckpt_format}; "
                        "use --ckpt-format torch_dist")
    if ns.train_iters and ns.train_samples:
        raise PlanError("--train-iters and --train-samples exclude each other; pick one")
    if ns.lr_warmup_fraction is not None and (ns.lr_warmup_iters or ns.lr_warmup_samples):
        raise PlanError("--lr-warmup-fraction excludes --lr-warmup-iters/--lr-warmup-samples")
    sources = [ns.mock_data, bool(ns.data_path),
               any((ns.train_data_path, ns.valid_data_path, ns.test_data_path))]
    if sum(sources) > 1:
        raise PlanError("give one data source: --mock-data, --data-path or "
                        "--train/valid/test-data-path")
    if ns.weight_decay_incr_style == "constant":
        if ns.start_weight_decay is not None or ns.end_weight_decay is not None:
            raise PlanError("--start/end-weight-decay need --weight-decay-incr-style linear or "
                            "cosine")
    elif ns.start_weight_decay is None or ns.end_weight_decay is None:
        raise PlanError(f"--weight-decay-incr-style {ns.weight_decay_incr_style} needs "
                        "--start-weight-decay and --end-weight-decay")
    if ns.optimizer not in ("adam", "sgd"):
        raise PlanError(f"--optimizer {ns.optimizer} is a Megatron setting megatron_ext does not "
                        "support yet; use adam or sgd")
    _check_tokenizer(ns)


def _check_tokenizer(ns: argparse.Namespace) -> None:
    kind = ns.tokenizer_type
    if kind not in SUPPORTED_TOKENIZERS:
        raise PlanError(
            f"--tokenizer-type {kind} is a Megatron setting megatron_ext does not support yet; "
            "use GPT2BPETokenizer, HuggingFaceTokenizer or NullTokenizer"
        )
    needs = {"GPT2BPETokenizer": ("vocab_file", "merge_file"),
             "HuggingFaceTokenizer": ("tokenizer_model",), "NullTokenizer": ("vocab_size",)}
    for dest in needs.get(kind, ()):
        if getattr(ns, dest) is None:
            raise PlanError(f"--tokenizer-type {kind} needs --{dest.replace('_', '-')}")


def _check_megatron_ext(ns: argparse.Namespace) -> None:
    if "vocab_parallel_algorithm" in ns.explicit_args and not ns.vocab_parallel:
        raise PlanError("--vocab-parallel-algorithm has no effect without --vocab-parallel")
    sizes = {"flexsp_max_group_size", "flexsp_min_group_size"} & ns.explicit_args
    if sizes and not ns.flexsp:
        raise PlanError("--flexsp-max/min-group-size have no effect without --flexsp")
    if ns.flexsp and ns.attention_dropout:
        raise PlanError(f"--attention-dropout={ns.attention_dropout} with --flexsp: FlexSP "
                        "attention has no dropout; pass --attention-dropout 0")


def _check_world(ns: argparse.Namespace, world_size: int, derived: set[str]) -> None:
    dp = data_parallel_size(ns, world_size)
    ep, pp = ns.expert_model_parallel_size, ns.pipeline_model_parallel_size
    etp = ns.expert_tensor_parallel_size or ns.tensor_model_parallel_size
    if ns.num_experts and None not in (ep, etp) and world_size % (ep * etp * pp):
        # megatron-core's initialize_model_parallel builds the expert groups from
        # world / (etp * ep * pp) ranks (parallel_state.py:785)
        raise PlanError(
            f"world size {world_size} is not divisible by --expert-tensor-parallel-size x "
            f"--expert-model-parallel-size x --pipeline-model-parallel-size = {etp * ep * pp}"
        )
    if ns.micro_batch_size is None:
        return
    if ns.global_batch_size is None:
        ns.global_batch_size = ns.micro_batch_size * dp
        derived.add("global_batch_size")
    if ns.global_batch_size % (ns.micro_batch_size * dp):
        raise PlanError(
            f"--global-batch-size={ns.global_batch_size} is not a multiple of --micro-batch-size "
            f"x data-parallel size = {ns.micro_batch_size} x {dp}; change the batch sizes"
        )


def _product(values: list[int]) -> int:
    result = 1
    for v in values:
        result *= v
    return result
