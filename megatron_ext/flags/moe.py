"""Megatron-LM's mixture-of-experts flags: parsing, validate_args' MoE rules, the plan's MoESpec.

Flag names, dests, defaults and choices follow Megatron-LM core_v0.16.1
`megatron/training/arguments.py` (`_add_moe_args` and the TransformerConfig-generated group).
The flags that shape the model (`--num-experts`, `--moe-router-topk`, `--moe-layer-freq`, ...)
become the plan's `model.moe` (specs.MoESpec); `--expert-model-parallel-size` and
`--expert-tensor-parallel-size` become the MoE layers' `ep`/`etp`. Implementation switches that do
not change the model (`--moe-token-dispatcher-type`, `--moe-grouped-gemm`, `--moe-router-dtype`,
...) are training flags (flags/training.py) the training run reads from the namespace.

Megatron-LM's own MoE rules (validate_args and TransformerConfig.__post_init__) are checked in
`check_moe_args`; MoESpec's constructor repeats the routing rules so plan files obey them too.
Nothing here imports torch or megatron.
"""

from __future__ import annotations

import argparse
import ast
import re
from typing import Any

from megatron_ext.errors import PlanError
from megatron_ext.flags.types import positive_int
from megatron_ext.specs import MOE_BALANCING, MoESpec

DISPATCHERS = ("allgather", "alltoall", "flex")


def moe_freq_type(text: str) -> int | list[int]:
    """Megatron-LM's moe_freq_type: an int N (layer i is MoE iff i % N == 0) or a Python list
    expression of 1 (MoE) / 0 (dense) such as "([0]*3+[1]*58)" or "([1]*3+[0]*2)*2".

    Megatron-LM checks the characters and eval()s the text; this evaluates the same grammar
    (integers, lists, +, *, parentheses) without eval."""
    text = str(text).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} must be an integer or a list pattern such as ([0]*3+[1]*58)"
            ) from None
    if re.search(r"[^,\d\[\]\(\)\+\*\s]", text) or len(text) > 10_000:
        raise argparse.ArgumentTypeError(f"invalid pattern {text!r}: use digits, [ ] ( ) + * ,")
    try:
        value = _evaluate(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(f"invalid pattern {text!r}: {err}") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"pattern {text!r} must give a list of 1/0")
    return value


def _evaluate(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_evaluate(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Mult):
            count = right if isinstance(right, int) else left
            if isinstance(count, int) and count > 100_000:
                raise ValueError("repeat count too large")
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"unsupported element {ast.dump(node)[:40]}")


def layer_freq_text(freq: int | tuple[int, ...] | list[int]) -> str:
    """--moe-layer-freq for a MoESpec.layer_freq: the int, or runs as "([0]*3+[1]*58)"."""
    if isinstance(freq, int):
        return str(freq)
    runs: list[list[int]] = []
    for value in freq:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return "(" + "+".join(f"[{v}]*{n}" if n > 1 else f"[{v}]" for v, n in runs) + ")"


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    """The model-shaping MoE flags and the expert parallel degrees."""
    g = parser.add_argument_group("mixture of experts (the plan's model.moe and ep/etp)")
    g.add_argument("--num-experts", type=int, default=None,
                   help="routed experts per MoE layer; 0 or absent: a dense model")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's FFN width; default --ffn-hidden-size")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="width of the shared experts, all of them together")
    g.add_argument("--moe-shared-expert-gate", action="store_true")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                   help="N (layer i is MoE iff i %% N == 0) or a pattern such as "
                   "'([0]*3+[1]*58)'")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", type=str,
                   choices=list(MOE_BALANCING), default="aux_loss")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-score-function", type=str, default="softmax",
                   choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-num-groups", type=int, default=None)
    g.add_argument("--moe-router-group-topk", type=int, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="tokens kept per expert relative to an even split; absent: dropless")
    g.add_argument("--moe-token-drop-policy", type=str, default="probs",
                   choices=["probs", "position"])
    g.add_argument("--expert-model-parallel-size", type=positive_int, default=1,
                   help="ep of every MoE layer")
    g.add_argument("--expert-tensor-parallel-size", type=positive_int, default=None,
                   help="etp of every MoE layer; default --tensor-model-parallel-size")


def add_moe_training_args(parser: argparse.ArgumentParser) -> None:
    """MoE implementation switches: same model, different kernels or communication."""
    g = parser.add_argument_group("mixture-of-experts implementation")
    g.add_argument("--moe-token-dispatcher-type", type=str, default="allgather",
                   choices=list(DISPATCHERS),
                   help="allgather (Megatron-LM's default) or alltoall; flex is refused")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="grouped expert GEMMs (transformer-engine); sequential experts without")
    g.add_argument("--moe-router-dtype", type=str, default=None, choices=["fp32", "fp64"],
                   help="router and expert-output weighting precision; default the input's")
    g.add_argument("--moe-input-jitter-eps", type=float, default=None,
                   help="multiplicative uniform noise on the router input in training")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="pad every expert to its capacity (needs --moe-expert-capacity-factor)")


def _single(ns: argparse.Namespace, dest: str, flag: str) -> Any:
    """Megatron-LM reduces a one-element list of --moe-router-load-balancing-type /
    --moe-aux-loss-coeff to its element (validate_args)."""
    value = getattr(ns, dest)
    if isinstance(value, list):
        if len(value) != 1:
            raise PlanError(f"{flag} {' '.join(map(str, value))}: several load-balancing losses "
                            "at once are not supported by megatron_ext; give one type and one "
                            "--moe-aux-loss-coeff")
        value = value[0]
        setattr(ns, dest, value)
    return value


def check_moe_args(ns: argparse.Namespace, derived: set[str]) -> None:
    """Megatron-LM core_v0.16.1's MoE rules (validate_args, TransformerConfig.__post_init__,
    MoELayer) in one-line errors; also resolves the derived MoE defaults as Megatron-LM does."""
    balancing = ns.moe_router_load_balancing_type
    coeff = ns.moe_aux_loss_coeff
    if isinstance(balancing, list) and isinstance(coeff, list) and len(balancing) != len(coeff):
        raise PlanError(f"--moe-aux-loss-coeff has {len(coeff)} values for {len(balancing)} "
                        "--moe-router-load-balancing-type entries; give one per type")
    _single(ns, "moe_router_load_balancing_type", "--moe-router-load-balancing-type")
    _single(ns, "moe_aux_loss_coeff", "--moe-aux-loss-coeff")
    if ns.num_experts == 0:  # Megatron-LM: 0 means a dense model
        ns.num_experts = None
    if ns.moe_token_dispatcher_type == "flex":
        raise PlanError("--moe-token-dispatcher-type flex: the flex dispatcher (DeepEP / "
                        "HybridEP fused all-to-all kernels) is not supported by megatron_ext; use "
                        "--moe-token-dispatcher-type alltoall")
    ep = ns.expert_model_parallel_size
    if ns.num_experts is None:
        if ep not in (1, None):
            raise PlanError(f"--expert-model-parallel-size={ep} needs --num-experts (Megatron-LM "
                            "requires it)")
        if ns.moe_ffn_hidden_size is not None:
            raise PlanError("--moe-ffn-hidden-size needs --num-experts (Megatron-LM requires "
                            "it)")
        return
    if ns.num_experts < 0:
        raise PlanError(f"--num-experts={ns.num_experts} must be >= 0")
    if ep is not None and ns.num_experts % ep:
        raise PlanError(f"--num-experts={ns.num_experts} is not a multiple of "
                        f"--expert-model-parallel-size={ep} (Megatron-LM requires it)")
    if ns.add_bias_linear:
        raise PlanError("--num-experts needs --disable-bias-linear: megatron-core's experts do "
                        "not train with linear biases (Megatron-LM's MoE recipes all disable "
                        "them)")
    tp = ns.tensor_model_parallel_size
    if tp not in (1, None) and not ns.sequence_parallel:
        raise PlanError(f"--num-experts with --tensor-model-parallel-size={tp} needs "
                        "--sequence-parallel (megatron-core's MoE layer refuses tensor "
                        "parallelism without it)")
    if ns.use_torch_fsdp2 and ep not in (1, None):
        raise PlanError("--use-torch-fsdp2 is not supported with expert parallelism "
                        "(Megatron-LM requires --expert-model-parallel-size 1)")
    if ns.moe_shared_expert_overlap and ns.moe_token_dispatcher_type != "alltoall":
        raise PlanError("--moe-shared-expert-overlap needs --moe-token-dispatcher-type alltoall "
                        "(megatron-core requires it)")
    if ns.moe_pad_expert_input_to_capacity and ns.moe_expert_capacity_factor is None:
        raise PlanError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor "
                        "(megatron-core requires it)")
    if ns.moe_expert_capacity_factor is not None and ns.moe_expert_capacity_factor < 0:
        ns.moe_expert_capacity_factor = None  # TransformerConfig: negative means dropless
    if ns.moe_ffn_hidden_size is None:
        ns.moe_ffn_hidden_size = ns.ffn_hidden_size
        derived.add("moe_ffn_hidden_size")
    freq = ns.moe_layer_freq
    if isinstance(freq, list) and ns.num_layers is not None and len(freq) != ns.num_layers:
        raise PlanError(f"--moe-layer-freq {layer_freq_text(freq)} gives {len(freq)} layers but "
                        f"--num-layers={ns.num_layers}; give one 1/0 per layer")
    if isinstance(freq, list) and 1 not in freq:
        raise PlanError(f"--moe-layer-freq {layer_freq_text(freq)} makes no layer MoE; drop "
                        "--num-experts for a dense model")
    try:
        moe_from_args(ns, derived)
    except PlanError as err:
        raise PlanError(f"these Megatron MoE flags give an invalid model: {err}") from None


_SPEC_FLAG = {
    "num_experts": "--num-experts", "router_topk": "--moe-router-topk",
    "ffn_hidden_size": "--moe-ffn-hidden-size",
    "shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "shared_expert_gate": "--moe-shared-expert-gate", "layer_freq": "--moe-layer-freq",
    "router_load_balancing_type": "--moe-router-load-balancing-type",
    "aux_loss_coeff": "--moe-aux-loss-coeff", "z_loss_coeff": "--moe-z-loss-coeff",
    "router_score_function": "--moe-router-score-function",
    "router_pre_softmax": "--moe-router-pre-softmax",
    "capacity_factor": "--moe-expert-capacity-factor",
    "router_topk_scaling_factor": "--moe-router-topk-scaling-factor",
    "router_num_groups": "--moe-router-num-groups",
    "router_group_topk": "--moe-router-group-topk",
    "router_enable_expert_bias": "--moe-router-enable-expert-bias",
    "router_bias_update_rate": "--moe-router-bias-update-rate",
    "token_drop_policy": "--moe-token-drop-policy",
}
"""MoESpec field -> the Megatron-LM flag that sets it."""


def moe_from_args(ns: argparse.Namespace, derived: set[str] | frozenset[str] | None = None
                  ) -> MoESpec | None:
    """The plan's model.moe from a namespace check_moe_args has seen; None without experts.
    `derived`: the dests Megatron-LM's defaults filled in (default ns.derived_args)."""
    if not ns.num_experts:
        return None
    _single(ns, "moe_router_load_balancing_type", "--moe-router-load-balancing-type")
    _single(ns, "moe_aux_loss_coeff", "--moe-aux-loss-coeff")
    freq = ns.moe_layer_freq
    derived_set: set[str] | frozenset[str] = (
        getattr(ns, "derived_args", frozenset()) if derived is None else derived)
    derived_ffn = "moe_ffn_hidden_size" in derived_set
    return MoESpec(
        num_experts=ns.num_experts,
        router_topk=ns.moe_router_topk,
        ffn_hidden_size=0 if derived_ffn or ns.moe_ffn_hidden_size is None
        else ns.moe_ffn_hidden_size,
        shared_expert_intermediate_size=ns.moe_shared_expert_intermediate_size or 0,
        shared_expert_gate=bool(ns.moe_shared_expert_gate),
        layer_freq=tuple(freq) if isinstance(freq, list) else freq,
        router_load_balancing_type=ns.moe_router_load_balancing_type,
        aux_loss_coeff=float(ns.moe_aux_loss_coeff),
        z_loss_coeff=ns.moe_z_loss_coeff or 0.0,
        router_score_function=ns.moe_router_score_function,
        router_pre_softmax=bool(ns.moe_router_pre_softmax),
        capacity_factor=ns.moe_expert_capacity_factor or 0.0,
        router_topk_scaling_factor=ns.moe_router_topk_scaling_factor or 0.0,
        router_num_groups=ns.moe_router_num_groups or 0,
        router_group_topk=ns.moe_router_group_topk or 0,
        router_enable_expert_bias=bool(ns.moe_router_enable_expert_bias),
        router_bias_update_rate=ns.moe_router_bias_update_rate,
        token_drop_policy=ns.moe_token_drop_policy,
    )


def moe_values(moe: MoESpec | None) -> dict[str, Any]:
    """Megatron-LM dests for a plan's model.moe (None: flag absent). Values equal to Megatron's
    default are left out, except the ones every Megatron-LM MoE recipe spells out."""
    keys = ("num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
            "moe_shared_expert_gate", "moe_layer_freq", "moe_router_topk",
            "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
            "moe_router_score_function", "moe_router_pre_softmax",
            "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
            "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
            "moe_expert_capacity_factor", "moe_token_drop_policy")
    if moe is None:
        return dict.fromkeys(keys)
    return {
        "num_experts": moe.num_experts,
        "moe_ffn_hidden_size": moe.ffn_hidden_size or None,
        "moe_shared_expert_intermediate_size": moe.shared_expert_intermediate_size or None,
        "moe_shared_expert_gate": moe.shared_expert_gate,
        "moe_layer_freq": None if moe.layer_freq == 1 else (
            moe.layer_freq if isinstance(moe.layer_freq, int) else list(moe.layer_freq)),
        "moe_router_topk": moe.router_topk,
        "moe_router_load_balancing_type": moe.router_load_balancing_type,
        "moe_aux_loss_coeff": moe.aux_loss_coeff,
        "moe_z_loss_coeff": moe.z_loss_coeff or None,
        "moe_router_score_function": None if moe.router_score_function == "softmax"
        else moe.router_score_function,
        "moe_router_pre_softmax": moe.router_pre_softmax,
        "moe_router_topk_scaling_factor": moe.router_topk_scaling_factor or None,
        "moe_router_num_groups": moe.router_num_groups or None,
        "moe_router_group_topk": moe.router_group_topk or None,
        "moe_router_enable_expert_bias": moe.router_enable_expert_bias,
        "moe_router_bias_update_rate": None if moe.router_bias_update_rate == 1e-3
        else moe.router_bias_update_rate,
        "moe_expert_capacity_factor": moe.capacity_factor or None,
        "moe_token_drop_policy": None if moe.token_drop_policy == "probs"
        else moe.token_drop_policy,
    }
