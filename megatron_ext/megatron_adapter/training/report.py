"""Per-interval log line, validation line, TensorBoard scalars, and loss reduction over ranks.

One line per `--log-interval` in Megatron-LM's ` key: value |` style, plus tokens/s, peak memory
and, when the plan carries the search's prediction, predicted beside measured iteration time.
"""

from __future__ import annotations

import logging
import math
import resource
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.plan import ParallelPlan

logger = logging.getLogger(__name__)


def reduce_loss(reports: list[dict[str, torch.Tensor]], reports_loss: bool) -> float:
    """Global mean token loss of one step: sum of (loss sum, tokens) over the reporting ranks."""
    total = torch.zeros(2, dtype=torch.float64)  # [loss sum, tokens]
    if reports_loss:
        for report in reports:
            total += report["lm loss"].detach().to("cpu", torch.float64)
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


def peak_memory_gib() -> float:
    """Peak accelerator memory of this rank; on CPU, the peak resident set size of the process."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


@dataclass(kw_only=True)
class IntervalStats:
    """Sums since the last log line."""

    losses: list[float] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    """Extra per-step values by name (MoE router losses), in first-seen order."""

    def add(self, loss: float, time_s: float, grad_norm: float | None,
            metrics: dict[str, float] | None = None) -> None:
        self.losses.append(loss)
        self.times_s.append(time_s)
        if grad_norm is not None:
            self.grad_norms.append(float(grad_norm))
        for name, value in (metrics or {}).items():
            self.metrics.setdefault(name, []).append(value)


class Reporter:
    """Writes the log lines (rank 0) and TensorBoard scalars (rank 0, when asked and importable)."""

    def __init__(self, *, plan: ParallelPlan, train_iters: int,
                 tensorboard_dir: str | None) -> None:
        self.plan = plan
        self.train_iters = train_iters
        self.stats = IntervalStats()
        self.is_writer = not dist.is_initialized() or dist.get_rank() == 0
        self.tb = self._tensorboard(tensorboard_dir) if self.is_writer else None

    @staticmethod
    def _tensorboard(directory: str | None) -> Any:
        if not directory:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            logger.warning("--tensorboard-dir=%s ignored: tensorboard is not installed "
                           "(pip install tensorboard)", directory)
            return None
        return SummaryWriter(log_dir=directory, max_queue=1000)

    def _prediction(self, measured_s: float) -> str:
        if self.plan.prediction is None:
            return ""
        predicted_s = self.plan.prediction.iteration_time_s
        drift = (measured_s / predicted_s - 1.0) * 100.0
        return (f" predicted {predicted_s * 1e3:.1f} ms / measured {measured_s * 1e3:.1f} ms "
                f"({drift:+.1f}%) |")

    def log_interval(self, *, iteration: int, consumed: int, lr: float, loss_scale: float,
                     skipped: int) -> None:
        """Log the interval's averages; every rank must call this (it reduces peak memory)."""
        stats, self.stats = self.stats, IntervalStats()
        peak_gib = _max_over_ranks(peak_memory_gib())
        if not self.is_writer or not stats.losses:
            return
        time_s = sum(stats.times_s) / len(stats.times_s)
        loss = sum(stats.losses) / len(stats.losses)
        tokens_per_s = self.plan.global_batch_size * self.plan.seq_length / time_s
        norm = (f" grad norm: {sum(stats.grad_norms) / len(stats.grad_norms):.6f} |"
                if stats.grad_norms else "")
        extra = {name: sum(v) / len(v) for name, v in stats.metrics.items()}
        # Megatron-LM prints its other loss-dict entries (router losses) as ' name: %.6E |'
        extra_text = "".join(f" {name}: {value:.6E} |" for name, value in extra.items())
        logger.info(
            " iteration %8d/%8d | consumed samples: %12d | elapsed time per iteration (ms): "
            "%.1f | learning rate: %.6E | global batch size: %5d | lm loss: %.9E |%s "
            "loss scale: %.1f |%s number of skipped iterations: %3d | tokens/s: %.1f | "
            "peak memory (GiB): %.3f |%s",
            iteration, self.train_iters, consumed, time_s * 1e3, lr,
            self.plan.global_batch_size, loss, extra_text, loss_scale, norm, skipped,
            tokens_per_s, peak_gib, self._prediction(time_s),
        )
        if self.tb is not None:
            for name, value in (("lm loss", loss), ("learning-rate", lr),
                                ("iteration-time", time_s), ("tokens-per-second", tokens_per_s),
                                ("peak-memory-gib", peak_gib)):
                self.tb.add_scalar(name, value, iteration)
            if stats.grad_norms:
                self.tb.add_scalar("grad-norm", stats.grad_norms[-1], iteration)
            for name, value in extra.items():
                self.tb.add_scalar(name, value, iteration)
            self.tb.flush()

    def log_validation(self, *, iteration: int, loss: float, label: str = "validation") -> None:
        if not self.is_writer:
            return
        ppl = math.exp(min(20.0, loss))
        logger.info(" %s loss at iteration %d | lm loss value: %.9E | lm loss PPL: %.6E |",
                    label, iteration, loss, ppl)
        if self.tb is not None:
            self.tb.add_scalar(f"lm loss {label}", loss, iteration)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
