"""Where a mixture-of-experts model meets a command: the one-line summary of its experts, and
the refusal of the layer profiler, which builds dense layers only (the cost model prices the
experts analytically: planner/cost/moe.py)."""

from __future__ import annotations

from megatron_ext.errors import PlanError
from megatron_ext.specs import ModelSpec


def refuse_moe_profile(model: ModelSpec) -> None:
    if model.moe is not None:
        raise PlanError(f"profile model: {model.name} is a mixture-of-experts model; profiling "
                        "MoE layers is not supported yet: profile its dense counterpart or use "
                        "the analytic cost model")


def moe_summary(model: ModelSpec) -> str:
    """One line for plan tables: the experts and which layers have them ("" for dense)."""
    moe = model.moe
    if moe is None:
        return ""
    moe_layers = [i for i in range(model.num_layers) if model.is_moe_layer(i)]
    parts = [f"{moe.num_experts} experts, top-{moe.router_topk}"
             + (" (pre-softmax)" if moe.router_pre_softmax else "")
             + ("" if moe.router_score_function == "softmax" else f" {moe.router_score_function}"),
             f"expert FFN {moe.expert_ffn_hidden_size(model)}"]
    if moe.shared_expert_intermediate_size:
        parts.append(f"shared {moe.shared_expert_intermediate_size}"
                     + (" gated" if moe.shared_expert_gate else ""))
    parts.append(f"{len(moe_layers)} of {model.num_layers} layers MoE")
    parts.append(f"{moe.router_load_balancing_type} {moe.aux_loss_coeff:g}")
    if moe.capacity_factor:
        parts.append(f"capacity factor {moe.capacity_factor:g}")
    return "  moe: " + ", ".join(parts) + "\n"
