"""The training loop: steps, learning-rate schedule, evaluation, periodic checkpoints.

Follows Megatron-LM's `train`/`train_step`/`evaluate`: zero the DDP grad buffers, run the
schedule over `global_batch_size / micro_batch_size` micro-batches, `optimizer.step()` (which
unscales, clips to `--clip-grad` and returns the grad norm), then advance the scheduler by one
global batch of samples.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_ext.megatron_adapter.training.backend import Backend, Batch
from megatron_ext.megatron_adapter.training.checkpoint import (
    TrainState,
    save_checkpoint,
)
from megatron_ext.megatron_adapter.training.checkpoint_async import AsyncSaver
from megatron_ext.megatron_adapter.training.checkpoint_write import save_strategy
from megatron_ext.megatron_adapter.training.data import MicroBatchIterator
from megatron_ext.megatron_adapter.training.preemption import (
    ExitSignalHandler,
    install_exit_signal_handler,
)
from megatron_ext.megatron_adapter.training.rampup import global_batch_size_at
from megatron_ext.megatron_adapter.training.report import Reporter
from megatron_ext.megatron_adapter.training.run_config import RunConfig

logger = logging.getLogger(__name__)


def build_scheduler(run: RunConfig, optimizer: Any) -> OptimizerParamScheduler:
    """Megatron-LM's `get_optimizer_param_scheduler`; its steps are samples (ScheduleConfig)."""
    sched, opt = run.schedule, run.optimizer
    return OptimizerParamScheduler(
        optimizer,
        init_lr=sched.lr_warmup_init,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=sched.lr_warmup_samples,
        lr_decay_steps=sched.lr_decay_samples,
        lr_decay_style=sched.lr_decay_style,
        start_wd=sched.start_weight_decay,
        end_wd=sched.end_weight_decay,
        wd_incr_steps=sched.train_samples,
        wd_incr_style=sched.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=sched.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=sched.override_opt_param_scheduler,
        wsd_decay_steps=sched.lr_wsd_decay_samples,
        lr_wsd_decay_style=sched.lr_wsd_decay_style,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """What one optimizer step reports, the same on every rank."""

    loss: float
    """Global mean token loss of the step."""
    grad_norm: float | None
    """Gradient norm before clipping (None when the optimizer does not compute it)."""
    update_successful: bool
    """False when the loss scaler skipped the update (fp16 overflow)."""


def train_step(backend: Backend, data: Iterator[Batch] | None,
               num_microbatches: int | None = None, *,
               scheduler: OptimizerParamScheduler | None = None,
               global_batch_size: int | None = None) -> StepResult:
    """One optimizer step, as Megatron-LM's `train_step`: zero the grad buffers, forward and
    backward over `num_microbatches` (default the plan's), `optimizer.step()`, then advance
    `scheduler` (when given) by `global_batch_size` samples. Training, the tests and the
    benchmarks all step through here."""
    for chunk in backend.model:
        chunk.zero_grad_buffer()
    backend.optimizer.zero_grad()
    loss = backend.forward_backward(data, num_microbatches, False)
    ok, grad_norm, _ = backend.optimizer.step()
    if ok and scheduler is not None:
        assert global_batch_size is not None, "a scheduler steps by samples"
        scheduler.step(increment=global_batch_size)
    return StepResult(loss=loss, grad_norm=None if grad_norm is None else float(grad_norm),
                      update_successful=bool(ok))


def evaluate(backend: Backend, data: Any, num_microbatches: int, eval_iters: int) -> float:
    """Mean validation loss over `eval_iters` global batches, dropout off."""
    for chunk in backend.model:
        chunk.eval()
    losses = []
    with torch.no_grad():
        for _ in range(eval_iters):
            losses.append(backend.forward_backward(data, num_microbatches, True))
    for chunk in backend.model:
        chunk.train()
    return sum(losses) / len(losses)


def _iterator(backend: Backend, dataset: Any, consumed: int, run: RunConfig,
              num_workers: int, cyclic: bool) -> MicroBatchIterator | None:
    if dataset is None or not backend.needs_data:
        return None
    return MicroBatchIterator(dataset, consumed=consumed,
                              global_micro_batch=run.batch.global_micro_batch_size,
                              shard=backend.shard, num_workers=num_workers, cyclic=cyclic)


def out_of_time(run: RunConfig, start_time_s: float) -> bool:
    """--exit-duration-in-mins: the same answer on every rank (any rank over the limit)."""
    limit = run.schedule.exit_duration_in_mins
    if not limit:
        return False
    done = torch.tensor([(time.time() - start_time_s) / 60.0 > limit], dtype=torch.int)
    if dist.is_initialized():
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
    return bool(done.item())


def train(run: RunConfig, backend: Backend, scheduler: OptimizerParamScheduler,
          datasets: list[Any], state: TrainState, *, start_time_s: float) -> TrainState:
    """Run from `state.iteration` to the run's last iteration, logging, evaluating and saving
    as asked. `start_time_s`: when the job started (--exit-duration-in-mins counts from it)."""
    plan, sched, save = run.plan, run.schedule, run.checkpoint.save
    train_ds, valid_ds = datasets[0], datasets[1]
    train_data = _iterator(backend, train_ds, state.consumed_train_samples, run,
                           run.data.num_workers, cyclic=False)
    valid_data = _iterator(backend, valid_ds, state.consumed_valid_samples, run, 0, cyclic=True)
    reporter = Reporter(plan=plan, train_iters=sched.train_iters,
                        tensorboard_dir=run.logging.tensorboard_dir)
    for chunk in backend.model:
        chunk.train()
    handler = install_exit_signal_handler(sched.exit_signals, backend)  # None: no handler
    saver = AsyncSaver(persistent=run.checkpoint.use_persistent_ckpt_worker,
                       shield=sched.exit_signals) if save and run.checkpoint.async_save else None
    strategy = (save_strategy(cached=True) if run.checkpoint.ckpt_assume_constant_structure
                else None)

    def checkpoint() -> None:
        assert save is not None
        save_checkpoint(save, backend, scheduler, state, plan,
                        with_optimizer=not run.checkpoint.no_save_optim, saver=saver,
                        strategy=strategy)
        reporter_info(reporter, f"saved checkpoint at iteration {state.iteration} to {save}"
                      if saver is None else f"saving checkpoint at iteration {state.iteration} "
                      f"to {save} in the background (--async-save)")

    try:
        last_saved = _steps(run, backend, scheduler, state, reporter, handler, saver,
                            checkpoint, train_data, valid_data, valid_ds,
                            start_time_s=start_time_s)
        if save and last_saved != state.iteration:
            checkpoint()
        if saver is not None:  # Megatron-LM: a blocking finalize before the run ends
            saver.close()
    except BaseException:
        if saver is not None:  # the tracker keeps naming the last finalized checkpoint
            saver.close(abort=True)
        raise
    if handler is not None:
        handler.release()
    reporter.close()
    return state


def _steps(run: RunConfig, backend: Backend, scheduler: OptimizerParamScheduler,
           state: TrainState, reporter: Reporter, handler: ExitSignalHandler | None,
           saver: AsyncSaver | None, checkpoint: Callable[[], None],
           train_data: MicroBatchIterator | None, valid_data: MicroBatchIterator | None,
           valid_ds: Any, *, start_time_s: float) -> int:
    """The steps of `train` until the last iteration or an exit condition; returns the
    iteration last saved."""
    sched, batch, save = run.schedule, run.batch, run.checkpoint.save
    log_interval = run.logging.log_interval
    eval_interval, eval_iters = sched.eval_interval, sched.eval_iters
    save_interval, last_saved = run.checkpoint.save_interval, state.iteration
    while state.iteration < sched.train_iters:
        start_s = time.perf_counter()
        global_batch = global_batch_size_at(batch, state.consumed_train_samples)
        step = train_step(backend, train_data, global_batch // batch.global_micro_batch_size,
                          scheduler=scheduler, global_batch_size=global_batch)
        state.iteration += 1
        state.consumed_train_samples += global_batch
        state.skipped_iterations += 0 if step.update_successful else 1
        reporter.stats.add(step.loss, time.perf_counter() - start_s, step.grad_norm,
                           backend.step_metrics)
        if saver is not None:  # Megatron-LM's maybe_finalize_async_save(blocking=False)
            saver.maybe_finalize()
        if state.iteration % log_interval == 0:
            reporter.log_interval(
                iteration=state.iteration, consumed=state.consumed_train_samples,
                lr=backend.optimizer.param_groups[0]["lr"],
                loss_scale=float(backend.optimizer.get_loss_scale()),
                skipped=state.skipped_iterations)
        if eval_interval and valid_ds is not None and eval_iters > 0 and \
                state.iteration % eval_interval == 0:
            reporter.log_validation(iteration=state.iteration, loss=evaluate(
                backend, valid_data, batch.num_microbatches, eval_iters))
            state.consumed_valid_samples += eval_iters * batch.global_batch_size
        if save and save_interval and state.iteration % save_interval == 0:
            checkpoint()
            last_saved = state.iteration
        received = handler.received() if handler is not None else None
        if received is not None:  # Megatron-LM: save at the end of this step, exit 0
            reporter_info(reporter, f"received {received.name}: exiting after iteration "
                                    f"{state.iteration} (--exit-signal-handler)")
            break
        if sched.exit_interval and state.iteration % sched.exit_interval == 0:
            reporter_info(reporter, f"exiting at iteration {state.iteration} (--exit-interval)")
            break
        if out_of_time(run, start_time_s):
            reporter_info(reporter, f"exiting at iteration {state.iteration} after "
                                    f"{sched.exit_duration_in_mins} minutes "
                                    "(--exit-duration-in-mins)")
            break
    return last_saved


def reporter_info(reporter: Reporter, message: str) -> None:
    if reporter.is_writer:
        logger.info(message)
