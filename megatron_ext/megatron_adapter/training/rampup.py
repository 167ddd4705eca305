"""--rampup-batch-size START INCREMENT SAMPLES with megatron-core's own calculator.

The plan (search, cost model, memory) is made for the final global batch size; during the ramp
the step runs fewer micro-batches of the plan's global micro-batch, so every intermediate batch
size must be a multiple of it (Megatron-LM asserts the same with decrease_batch_size_if_needed
off: num_microbatches_calculator.py `RampupBatchsizeNumMicroBatchesCalculator.update`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

from megatron_ext.errors import PlanError

if TYPE_CHECKING:
    from megatron_ext.megatron_adapter.training.run_config import BatchConfig

__all__ = ["check_rampup", "global_batch_size_at"]


def check_rampup(batch: BatchConfig) -> None:
    """One-line PlanError for a ramp megatron-core would reject or the plan cannot run."""
    assert batch.rampup_batch_size is not None
    start, increment, samples = batch.rampup_batch_size
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    gbs, unit = batch.global_batch_size, batch.global_micro_batch_size
    if start < 1 or increment < 1 or samples < 0:
        raise PlanError(f"{flag}: start and increment must be >= 1 and samples >= 0")
    if start > gbs or (gbs - start) % increment:
        raise PlanError(f"{flag}: the ramp must reach --global-batch-size={gbs} in whole "
                        f"increments from the start")
    if start == gbs:
        raise PlanError(f"{flag}: the start equals --global-batch-size={gbs}; drop the flag")
    if start % unit or increment % unit:
        raise PlanError(f"{flag}: start and increment must be multiples of the plan's global "
                        f"micro-batch ({unit} samples = --micro-batch-size x data-parallel size)")


@lru_cache(maxsize=8)
def _calculator(batch: BatchConfig) -> RampupBatchsizeNumMicroBatchesCalculator:
    assert batch.rampup_batch_size is not None
    start, increment, samples = batch.rampup_batch_size
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=batch.global_batch_size, micro_batch_size=batch.global_micro_batch_size,
        data_parallel_size=1, decrease_batch_size_if_needed=False, rank=-1,
        start_global_batch_size=start, batch_size_increment=increment, ramup_samples=samples)


def global_batch_size_at(batch: BatchConfig, consumed_samples: int) -> int:
    """Global batch size of the step that starts after `consumed_samples` samples."""
    if batch.rampup_batch_size is None:
        return batch.global_batch_size
    calculator = _calculator(batch)
    calculator.update(consumed_samples, consistency_check=True)
    return int(calculator.get_current_global_batch_size())
