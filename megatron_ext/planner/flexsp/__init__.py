"""FlexSP planner (no torch): per-step Ulysses groups of different sizes for variable lengths.

    cost = cost_model_from_specs(model_preset("llama2-7b"), cluster_preset("dgx-h100", num_nodes=8))
    plan = plan_step(lengths, cost)          # StepPlan: micro-batches -> groups -> sequence ids
    exact = solve_microbatch_milp(lengths, cost)   # HiGHS MILP oracle for small instances
    for lengths, plan in plan_ahead(batches, cost): ...   # plans batch i+1 while i trains

See cost.py for the cost model (FlexSP Eqs. 11-14) and planner.py for the search.
"""

from megatron_ext.planner.flexsp.cost import (
    FlexSPCostModel,
    cost_model_from_specs,
    paper_gpt7b_a100,
)
from megatron_ext.planner.flexsp.lengths import (
    DISTRIBUTIONS,
    sample_lengths,
    tail_stats,
)
from megatron_ext.planner.flexsp.milp import MilpResult, solve_microbatch_milp
from megatron_ext.planner.flexsp.planner import (
    PlannerOptions,
    plan_step,
    step_lower_bound,
)
from megatron_ext.planner.flexsp.prefetch import plan_ahead
from megatron_ext.planner.flexsp.step_plan import (
    MicroBatchPlan,
    SPGroup,
    StepPlan,
    token_split,
)

__all__ = [
    "DISTRIBUTIONS",
    "FlexSPCostModel",
    "MicroBatchPlan",
    "MilpResult",
    "PlannerOptions",
    "SPGroup",
    "StepPlan",
    "cost_model_from_specs",
    "paper_gpt7b_a100",
    "plan_ahead",
    "plan_step",
    "sample_lengths",
    "solve_microbatch_milp",
    "step_lower_bound",
    "tail_stats",
    "token_split",
]
