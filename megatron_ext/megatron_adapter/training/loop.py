"""The training loop: steps, learning-rate schedule, evaluation, periodic checkpoints.

Follows Megatron-LM's `train`/`train_step`/`evaluate`: zero the DDP grad buffers, run the
schedule over `global_batch_size / micro_batch_size` micro-batches, `optimizer.step()` (which
unscales, clips to `--clip-grad` and returns the grad norm), then advance the scheduler by one
global batch of samples.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_ext.megatron_adapter.training.backend import Backend
from megatron_ext.megatron_adapter.training.checkpoint import (
    TrainState,
    save_checkpoint,
)
from megatron_ext.megatron_adapter.training.data import MicroBatchIterator
from megatron_ext.megatron_adapter.training.report import Reporter
from megatron_ext.plan import ParallelPlan

logger = logging.getLogger(__name__)


def _flag(args: argparse.Namespace, name: str, default: Any) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def build_scheduler(args: argparse.Namespace, optimizer: Any) -> OptimizerParamScheduler:
    """Megatron-LM's `get_optimizer_param_scheduler` for iteration-based training."""
    gbs = args.global_batch_size
    decay_steps = _flag(args, "lr_decay_iters", args.train_iters) * gbs
    warmup_fraction = getattr(args, "lr_warmup_fraction", None)
    warmup_steps = (warmup_fraction * decay_steps if warmup_fraction is not None
                    else _flag(args, "lr_warmup_iters", 0) * gbs)
    wsd_iters = getattr(args, "lr_wsd_decay_iters", None)
    weight_decay = _flag(args, "weight_decay", 0.01)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=_flag(args, "lr_warmup_init", 0.0),
        max_lr=args.lr,
        min_lr=_flag(args, "min_lr", 0.0),
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=_flag(args, "lr_decay_style", "linear"),
        start_wd=_flag(args, "start_weight_decay", weight_decay),
        end_wd=_flag(args, "end_weight_decay", weight_decay),
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style=_flag(args, "weight_decay_incr_style", "constant"),
        use_checkpoint_opt_param_scheduler=bool(
            _flag(args, "use_checkpoint_opt_param_scheduler", False)),
        override_opt_param_scheduler=bool(_flag(args, "override_opt_param_scheduler", False)),
        wsd_decay_steps=wsd_iters * gbs if wsd_iters else None,
        lr_wsd_decay_style=getattr(args, "lr_wsd_decay_style", None),
    )


def train_step(backend: Backend, scheduler: OptimizerParamScheduler, data: Any,
               num_microbatches: int, global_batch_size: int) -> tuple[float, float | None, bool]:
    """One optimizer step; returns (global mean loss, grad norm, whether the update happened)."""
    for chunk in backend.model:
        chunk.zero_grad_buffer()
    backend.optimizer.zero_grad()
    loss = backend.forward_backward(data, num_microbatches, False)
    ok, grad_norm, _ = backend.optimizer.step()
    if ok:
        scheduler.step(increment=global_batch_size)
    return loss, grad_norm, ok


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


def _iterator(backend: Backend, dataset: Any, consumed: int, plan: ParallelPlan,
              num_workers: int, cyclic: bool) -> MicroBatchIterator | None:
    if dataset is None or not backend.needs_data:
        return None
    return MicroBatchIterator(dataset, consumed=consumed, global_micro_batch=plan.micro_batch_size,
                              shard=backend.shard, num_workers=num_workers, cyclic=cyclic)


def train(args: argparse.Namespace, plan: ParallelPlan, backend: Backend,
          scheduler: OptimizerParamScheduler, datasets: list[Any], state: TrainState) -> TrainState:
    """Run from `state.iteration` to `--train-iters`, logging, evaluating and saving as asked."""
    num_workers = _flag(args, "num_workers", 2)
    train_ds, valid_ds = datasets[0], datasets[1]
    train_data = _iterator(backend, train_ds, state.consumed_train_samples, plan, num_workers,
                           cyclic=False)
    valid_data = _iterator(backend, valid_ds, state.consumed_valid_samples, plan, 0, cyclic=True)
    reporter = Reporter(plan=plan, train_iters=args.train_iters,
                        tensorboard_dir=getattr(args, "tensorboard_dir", None))
    log_interval = _flag(args, "log_interval", 100)
    eval_interval, eval_iters = getattr(args, "eval_interval", None), _flag(args, "eval_iters", 100)
    save_interval, last_saved = getattr(args, "save_interval", None), state.iteration
    for chunk in backend.model:
        chunk.train()
    while state.iteration < args.train_iters:
        start_s = time.perf_counter()
        loss, grad_norm, ok = train_step(backend, scheduler, train_data, plan.num_microbatches,
                                         plan.global_batch_size)
        state.iteration += 1
        state.consumed_train_samples += plan.global_batch_size
        state.skipped_iterations += 0 if ok else 1
        reporter.stats.add(loss, time.perf_counter() - start_s, grad_norm)
        if state.iteration % log_interval == 0:
            reporter.log_interval(
                iteration=state.iteration, consumed=state.consumed_train_samples,
                lr=backend.optimizer.param_groups[0]["lr"],
                loss_scale=float(backend.optimizer.get_loss_scale()),
                skipped=state.skipped_iterations)
        if eval_interval and valid_ds is not None and eval_iters > 0 and \
                state.iteration % eval_interval == 0:
            reporter.log_validation(iteration=state.iteration, loss=evaluate(
                backend, valid_data, plan.num_microbatches, eval_iters))
            state.consumed_valid_samples += eval_iters * plan.global_batch_size
        if args.save and save_interval and state.iteration % save_interval == 0:
            save_checkpoint(args.save, backend, scheduler, state, plan)
            last_saved = state.iteration
            reporter_info(reporter, f"saved checkpoint at iteration {state.iteration} "
                                    f"to {args.save}")
        exit_interval = getattr(args, "exit_interval", None)
        if exit_interval and state.iteration % exit_interval == 0:
            reporter_info(reporter, f"exiting at iteration {state.iteration} (--exit-interval)")
            break
    if args.save and last_saved != state.iteration:
        save_checkpoint(args.save, backend, scheduler, state, plan)
        reporter_info(reporter, f"saved checkpoint at iteration {state.iteration} to {args.save}")
    reporter.close()
    return state


def reporter_info(reporter: Reporter, message: str) -> None:
    if reporter.is_writer:
        logger.info(message)
