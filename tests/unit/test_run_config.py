"""The run configuration (training/run_config.py) and the table of settings x backends
(training/select.py): Megatron-LM's validate_args numerics, sample-based schedules, batch ramp-up,
and which backend honours or refuses each setting."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from megatron_ext.errors import PlanError
from megatron_ext.flags.parser import parse_megatron_args, plan_from_megatron_args
from megatron_ext.megatron_adapter.training.rampup import global_batch_size_at
from megatron_ext.megatron_adapter.training.run_config import RunConfig, build_run_config
from megatron_ext.megatron_adapter.training.select import (
    BACKEND_SETTINGS,
    BACKENDS,
    check_backend_settings,
    select_backend,
)

WORLD = 4
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--max-position-embeddings", "256", "--seq-length", "64", "--micro-batch-size", "1",
        "--vocab-size", "512", "--lr", "1e-3"]


def run_of(*extra: str, train: tuple[str, ...] = ("--train-iters", "10"), cpu: bool = True,
           have_te: bool = False) -> RunConfig:
    ns = parse_megatron_args([*BASE, *train, *extra], world_size=WORLD)
    before = copy.deepcopy(vars(ns))
    plan = plan_from_megatron_args(ns, WORLD)
    run = build_run_config(ns, plan, cpu=cpu, have_te=have_te, have_wgrad_kernel=False)
    assert vars(ns) == before, "building the run config must not modify the namespace"
    return run


def test_frozen_and_batch_names() -> None:
    run = run_of("--global-batch-size", "8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.batch.global_batch_size = 16  # type: ignore[misc]
    # --micro-batch-size 1 per replica x dp 4 = 4 samples of all replicas per micro-batch
    assert (run.batch.global_micro_batch_size, run.batch.num_microbatches) == (4, 2)
    assert run.plan.micro_batch_size == run.batch.global_micro_batch_size


def test_megatron_defaults_reach_the_run() -> None:
    run = run_of()
    assert (run.model.hidden_dropout, run.model.attention_dropout) == (0.1, 0.1)
    assert run.optimizer.check_for_nan_in_loss_and_grad  # Megatron-LM's default
    assert run.data.mmap_bin_files
    assert not run.optimizer.grad_reduce_in_fp32  # fp32 run: nothing to accumulate higher
    assert not run.model.masked_softmax_fusion  # CPU: no fused kernels
    assert run_of(cpu=False).model.masked_softmax_fusion


@pytest.mark.parametrize(("flags", "fp32_grads"), [
    (("--bf16",), True),  # validate_args: bf16 accumulates and all-reduces in fp32
    (("--bf16", "--grad-reduce-in-bf16"), False),
    (("--bf16", "--accumulate-allreduce-grads-in-fp32"), True),
    ((), False),
    (("--accumulate-allreduce-grads-in-fp32",), True),
])
def test_gradient_dtype_follows_megatron(flags: tuple[str, ...], fp32_grads: bool) -> None:
    assert run_of(*flags).optimizer.grad_reduce_in_fp32 is fp32_grads


def test_nan_check_switches() -> None:
    assert not run_of("--no-check-for-nan-in-loss-and-grad").optimizer \
        .check_for_nan_in_loss_and_grad
    # fp16 with dynamic loss scaling: the scaler reads NaNs itself (validate_args turns it off)
    assert not run_of("--fp16").optimizer.check_for_nan_in_loss_and_grad
    assert run_of("--fp16", "--loss-scale", "1024").optimizer.check_for_nan_in_loss_and_grad


def test_no_mmap_bin_files_and_rope_options_reach_the_run() -> None:
    run = run_of("--no-mmap-bin-files", "--position-embedding-type", "rope", "--use-rope-scaling",
                 "--rotary-seq-len-interpolation-factor", "2", "--rotary-base", "500000")
    assert not run.data.mmap_bin_files
    assert (run.plan.model.rope_scaling, run.model.rotary_seq_len_interpolation_factor,
            run.plan.model.rotary_base) == (True, 2, 500000)


def test_iteration_schedule_in_samples() -> None:
    run = run_of("--global-batch-size", "8", "--lr-decay-iters", "6", "--lr-warmup-iters", "2",
                 "--lr-wsd-decay-iters", "3")
    s = run.schedule
    assert (s.train_iters, s.train_samples, s.lr_decay_samples, s.lr_warmup_samples,
            s.lr_wsd_decay_samples) == (10, 80, 48, 16, 24)


def test_sample_schedule_as_megatron() -> None:
    run = run_of("--global-batch-size", "8", "--lr-warmup-fraction", "0.25",
                 train=("--train-samples", "100"))
    s = run.schedule
    # training.py update_train_iters: 100 // 8; get_optimizer_param_scheduler: decay over the
    # train samples, warmup a fraction of the decay
    assert (s.train_iters, s.train_samples, s.lr_decay_samples, s.lr_warmup_samples) == (
        12, 100, 100, 25.0)


def test_rampup_matches_megatron_update_train_iters() -> None:
    run = run_of("--global-batch-size", "12", "--rampup-batch-size", "4", "4", "32",
                 train=("--train-samples", "200"))
    # 16 samples per increment: gbs 4 for consumed < 16, 8 for < 32, then 12
    assert [global_batch_size_at(run.batch, c) for c in (0, 12, 16, 28, 32, 33)] == [
        4, 4, 8, 8, 12, 12]
    # ramp: 0,4,8,12 (4 each) -> 16,24 (8 each) -> 32 (12) -> 44; then (200 - 44) // 12 = 13
    assert run.schedule.train_iters == 7 + 13


@pytest.mark.parametrize(("gbs", "ramp"), [(12, (4, 4, 32)), (64, (8, 8, 1000)),
                                          (48, (16, 16, 7))])
def test_rampup_equals_megatron_core_0_16_calculator(gbs: int, ramp: tuple[int, int, int]
                                                     ) -> None:
    """The ramp is computed here on every version (0.19 removed megatron-core's linear ramp);
    where megatron-core still has the class (0.16.x), both give the same batch size."""
    calculators = pytest.importorskip("megatron.core.num_microbatches_calculator")
    if not hasattr(calculators, "RampupBatchsizeNumMicroBatchesCalculator"):
        pytest.skip("this megatron-core has no linear ramp calculator (0.19: removed)")
    run = run_of("--global-batch-size", str(gbs), "--rampup-batch-size", *map(str, ramp),
                 train=("--train-samples", "4000"))
    start, increment, samples = ramp
    reference = calculators.RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=gbs, micro_batch_size=run.batch.global_micro_batch_size,
        data_parallel_size=1, decrease_batch_size_if_needed=False, rank=-1,
        start_global_batch_size=start, batch_size_increment=increment, ramup_samples=samples)
    for consumed in range(samples + 3 * gbs):
        reference.update(consumed, consistency_check=True)
        assert global_batch_size_at(run.batch, consumed) == \
            reference.get_current_global_batch_size(), consumed


@pytest.mark.parametrize(("extra", "train", "message"), [
    (("--lr-decay-samples", "10"), ("--train-iters", "10"), "--lr-decay-samples needs sample"),
    (("--lr-decay-iters", "10"), ("--train-samples", "80"), "--lr-decay-iters needs iteration"),
    (("--rampup-batch-size", "4", "4", "32"), ("--train-iters", "10"),
     "--rampup-batch-size needs sample"),
    (("--global-batch-size", "12", "--rampup-batch-size", "2", "2", "32"),
     ("--train-samples", "80"), "multiples of the plan's global micro-batch"),
    (("--global-batch-size", "12", "--rampup-batch-size", "8", "8", "32"),
     ("--train-samples", "80"), "in whole increments"),
])
def test_schedule_refusals(extra: tuple[str, ...], train: tuple[str, ...], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        run_of(*extra, train=train)


# The table users rely on: each setting -> the backends that refuse it (all others honour it).
EXPECTED_REFUSALS: dict[str, set[str]] = {
    "--overlap-grad-reduce": set(),
    "--overlap-param-gather": set(),
    "--check-for-nan-in-loss-and-grad (on by default)": set(),
    "--accumulate-allreduce-grads-in-fp32 (default with --bf16)": set(),
    "--ddp-bucket-size": set(),
    "--calculate-per-token-loss": set(),
    "--eod-mask-loss without --calculate-per-token-loss": {"layerwise", "vocab_parallel",
                                                          "flexsp"},
    "--reset-attention-mask": {"layerwise", "vocab_parallel"},
    "--fp16": set(),
    "--use-rope-scaling": set(),
    "--rotary-seq-len-interpolation-factor": set(),
    "--rampup-batch-size": set(),
    "--exit-duration-in-mins": set(),
    "--attention-dropout other than 0": {"flexsp"},
    "--num-experts (a mixture-of-experts model)": {"stock", "flexsp"},
    "--fp8-param-gather": {"layerwise", "vocab_parallel"},
}
# Flags that turn each setting on (on top of BASE).
TURN_ON: dict[str, tuple[str, ...]] = {
    "--overlap-grad-reduce": ("--overlap-grad-reduce",),
    "--overlap-param-gather": ("--overlap-param-gather", "--overlap-grad-reduce",
                               "--use-distributed-optimizer"),
    "--check-for-nan-in-loss-and-grad (on by default)": (),
    "--accumulate-allreduce-grads-in-fp32 (default with --bf16)": ("--bf16",),
    "--ddp-bucket-size": ("--ddp-bucket-size", "4000"),
    "--calculate-per-token-loss": ("--calculate-per-token-loss",),
    "--eod-mask-loss without --calculate-per-token-loss": ("--eod-mask-loss",),
    "--reset-attention-mask": ("--reset-attention-mask",),
    "--fp16": ("--fp16",),
    "--use-rope-scaling": ("--use-rope-scaling",),
    "--rotary-seq-len-interpolation-factor": ("--rotary-seq-len-interpolation-factor", "2"),
    "--rampup-batch-size": ("--global-batch-size", "8", "--rampup-batch-size", "4", "4", "8"),
    "--exit-duration-in-mins": ("--exit-duration-in-mins", "5"),
    "--attention-dropout other than 0": (),
    "--num-experts (a mixture-of-experts model)": ("--num-experts", "4",
                                                   "--disable-bias-linear"),
    "--fp8-param-gather": ("--bf16", "--fp8-format", "hybrid", "--fp8-param-gather",
                           "--use-distributed-optimizer"),
}


def test_table_covers_every_setting() -> None:
    assert {s.flag for s in BACKEND_SETTINGS} == set(EXPECTED_REFUSALS) == set(TURN_ON)


@pytest.mark.parametrize("flag", sorted(EXPECTED_REFUSALS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_settings_x_backends(flag: str, backend: str) -> None:
    extra = TURN_ON[flag]
    sample_based = "--rampup-batch-size" in extra
    run = run_of(*extra, train=("--train-samples", "80") if sample_based else
                 ("--train-iters", "10"))
    setting = next(s for s in BACKEND_SETTINGS if s.flag == flag)
    assert setting.is_on(run), f"{extra} must turn {flag} on"
    if backend in EXPECTED_REFUSALS[flag]:
        with pytest.raises(PlanError) as err:
            check_backend_settings(run, backend)
        assert flag in str(err.value) and backend in str(err.value)
    else:
        try:
            check_backend_settings(run, backend)
        except PlanError as err:  # refused for another setting this run also turns on
            assert flag not in str(err)


@pytest.mark.parametrize(("extra", "have_te", "backend"), [
    ((), False, "stock"),
    (("--tensor-model-parallel-size", "2"), False, "stock"),
    (("--context-parallel-size", "2"), True, "stock"),
    # megatron-core's local attention has no context parallelism: the layerwise ring attention
    (("--context-parallel-size", "2"), False, "layerwise"),
    (("--context-parallel-size", "2", "--cp-comm-type", "a2a"), True, "layerwise"),
    (("--vocab-parallel", "--pipeline-model-parallel-size", "2"), False, "vocab_parallel"),
    (("--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-model-parallel-size", "2",
      "--global-batch-size", "8"), False, "layerwise"),
    (("--flexsp", "--flexsp-max-group-size", "4", "--attention-dropout", "0"), False, "flexsp"),
])
def test_which_backend_runs_a_plan(extra: tuple[str, ...], have_te: bool, backend: str) -> None:
    assert select_backend(run_of(*extra, have_te=have_te)) == backend
