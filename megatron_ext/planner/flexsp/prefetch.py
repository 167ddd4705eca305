"""Plan the next global batch while the current one trains (FlexSP §6 one-step lookahead).

FlexSP forks a solver process per step because its MILP takes seconds. The fast planner takes
milliseconds, so one worker thread is enough: while step i runs (GPU kernels release the GIL),
the thread plans step i+1. Every rank can run its own prefetcher on the same batches: the
planner is deterministic, so no plan broadcast is needed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from megatron_ext.planner.flexsp.cost import FlexSPCostModel
from megatron_ext.planner.flexsp.planner import PlannerOptions, plan_step
from megatron_ext.planner.flexsp.step_plan import StepPlan

__all__ = ["plan_ahead"]


def plan_ahead(
    batches: Iterable[Sequence[int] | np.ndarray], cost: FlexSPCostModel,
    options: PlannerOptions | None = None,
) -> Iterator[tuple[np.ndarray, StepPlan]]:
    """Yield (lengths, plan) per batch, planning batch i+1 on a thread while i is consumed.
    A planner error surfaces when its batch is reached."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="flexsp-plan") as pool:
        pending: tuple[np.ndarray, Future[StepPlan]] | None = None
        for batch in batches:
            lengths = np.asarray(batch, dtype=np.int64)
            future = pool.submit(plan_step, lengths, cost, options)
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = (lengths, future)
        if pending is not None:
            yield pending[0], pending[1].result()
