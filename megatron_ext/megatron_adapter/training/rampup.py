"""--rampup-batch-size START INCREMENT SAMPLES: Megatron-LM's linear batch-size ramp.

megatron-core 0.16.1 computes it in `RampupBatchsizeNumMicroBatchesCalculator`
(num_microbatches_calculator.py:360-484); 0.19 removed that class (only a step schedule is left),
so the package computes the same ramp on every version: the batch grows by INCREMENT every
SAMPLES / ((GBS - START) / INCREMENT) consumed samples and is GBS once more than SAMPLES samples
are consumed (tests/unit/test_rampup.py compares it with 0.16.1's calculator where it exists).

The plan (search, cost model, memory) is made for the final global batch size; during the ramp
the step runs fewer micro-batches of the plan's global micro-batch, so every intermediate batch
size must be a multiple of it (Megatron-LM asserts the same with decrease_batch_size_if_needed
off: num_microbatches_calculator.py `RampupBatchsizeNumMicroBatchesCalculator.update`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def global_batch_size_at(batch: BatchConfig, consumed_samples: int) -> int:
    """Global batch size of the step that starts after `consumed_samples` samples."""
    if batch.rampup_batch_size is None:
        return batch.global_batch_size
    start, increment, samples = batch.rampup_batch_size
    gbs = batch.global_batch_size
    if consumed_samples > samples:
        return gbs
    samples_per_increment = samples / ((gbs - start) // increment)
    steps = int(consumed_samples / samples_per_increment) if samples_per_increment else 0
    return min(start + steps * increment, gbs)
