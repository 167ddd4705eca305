"""The load line says what was restored and what restarted, as Megatron-LM's load_checkpoint
(megatron/training/checkpointing.py) decides it: --no-load-optim skips the optimizer state and
the learning-rate schedule but keeps the iteration and consumed samples; --finetune also starts
the iteration, the samples and the RNG states from scratch."""

from __future__ import annotations

from megatron_ext.megatron_adapter.training.checkpoint import load_summary


def _summary(**changes: object) -> list[str]:
    fields = {"same_plan": True, "load_optimizer": True, "load_rng": True, "with_rng": True,
              "finetune": False, "iteration": 10, "schedule_samples": 80, **changes}
    return load_summary(**fields).split("; ")  # type: ignore[arg-type]


def test_full_resume_restores_everything() -> None:
    assert _summary() == [
        "weights restored", "optimizer state restored",
        "learning-rate schedule restored (at sample 80)",
        "iteration 10 and consumed samples restored", "RNG states restored"]


def test_no_load_optim_restarts_moments_and_schedule_only() -> None:
    assert _summary(load_optimizer=False, same_plan=False, with_rng=False) == [
        "weights restored (resharded from another plan)",
        "optimizer state restarted (--no-load-optim)",
        "learning-rate schedule restarted (--no-load-optim)",
        "iteration 10 and consumed samples restored",
        "RNG states restarted (saved under another plan, and they are per rank)"]


def test_other_plan_reshards_the_optimizer_state() -> None:
    assert _summary(same_plan=False, with_rng=False)[1] == "optimizer state restored (resharded)"


def test_finetune_restarts_all_but_the_weights() -> None:
    assert _summary(load_optimizer=False, load_rng=False, with_rng=False, finetune=True) == [
        "weights restored", "optimizer state restarted (--finetune)",
        "learning-rate schedule restarted (--finetune)",
        "iteration and consumed samples restarted at 0 (--finetune, saved at 10)",
        "RNG states restarted (--finetune)"]
