"""Where a mixture-of-experts model meets a part that must understand its experts.

plan-from-args, args and validate read MoE plans fully; the cost model (search, evaluate) and
the layer profiler must price or build the experts, or an MoE model would be planned as the dense
model of the same shape (Mixtral-8x7B as 7.24B parameters). These checks refuse that in one line.
"""

from __future__ import annotations

import dataclasses

from megatron_ext.errors import PlanError
from megatron_ext.planner.cost.compute import model_parameters
from megatron_ext.specs import ModelSpec


def require_priced_experts(model: ModelSpec, command: str) -> None:
    """The cost model must count the experts: refuse while it prices an MoE model as dense."""
    if model.moe is None:
        return
    if model_parameters(model) == model_parameters(dataclasses.replace(model, moe=None)):
        raise PlanError(f"{command}: {model.name} is a mixture-of-experts model "
                        f"({model.moe.num_experts} experts) and this cost model does not price "
                        "experts yet; plan-from-args, args and validate read MoE plans")


def refuse_moe_profile(model: ModelSpec) -> None:
    if model.moe is not None:
        raise PlanError(f"profile model: {model.name} is a mixture-of-experts model; profiling "
                        "MoE layers is not supported yet: profile its dense counterpart or use "
                        "the analytic cost model")
