"""Training log lines print the plan's predicted iteration time beside the measured one."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from megatron_ext.megatron_adapter.training.report import Reporter
from megatron_ext.plan import LayerStrategy, ParallelPlan, Prediction, VocabStrategy
from megatron_ext.presets import model_preset


def _plan(prediction: Prediction | None) -> ParallelPlan:
    model = model_preset("tiny-gpt")
    return ParallelPlan(world_size=1, pp=1, stages=((0, model.num_layers),),
                        layers=(LayerStrategy(),) * model.num_layers, model=model,
                        micro_batch_size=2, global_batch_size=4, seq_length=64,
                        vocab=VocabStrategy(), precision="fp32", prediction=prediction)


def _log_line(plan: ParallelPlan, times_s: list[float], caplog: pytest.LogCaptureFixture) -> str:
    reporter = Reporter(plan=plan, train_iters=10, tensorboard_dir=None)
    for t in times_s:
        reporter.stats.add(loss=2.0, time_s=t, grad_norm=1.0)
    with caplog.at_level(logging.INFO, logger="megatron_ext.megatron_adapter.training.report"):
        reporter.log_interval(iteration=len(times_s), consumed=8, lr=1e-4, loss_scale=1.0,
                              skipped=0)
    (record,) = caplog.records
    return record.getMessage()


def test_log_line_prints_predicted_beside_measured(caplog):
    plan = _plan(Prediction(iteration_time_s=0.25, tokens_per_s=1024.0))
    line = _log_line(plan, [0.2, 0.3], caplog)  # measured mean 0.25 s
    assert "elapsed time per iteration (ms): 250.0" in line
    assert "predicted 250.0 ms / measured 250.0 ms (+0.0%)" in line
    caplog.clear()
    slower = dataclasses.replace(plan, prediction=Prediction(iteration_time_s=0.2,
                                                              tokens_per_s=1280.0))
    assert "predicted 200.0 ms / measured 250.0 ms (+25.0%)" in _log_line(slower, [0.25], caplog)


def test_log_line_without_prediction_has_no_predicted_field(caplog):
    line = _log_line(_plan(None), [0.25], caplog)
    assert "elapsed time per iteration (ms): 250.0" in line
    assert "predicted" not in line
