"""Real megatron-core 0.16.1 on CPU/gloo through `cpu_compat`: TP, TP+SP, PP 1F1B, DP+distopt, ckpt.

A spawn costs seconds (two ranks importing megatron on two cores), so two module-scoped spawns
run every check (rank code in mcore_cpu_checks.py) and each test asserts on its own outcome.
Test names contain "cpu_compat": `-k cpu_compat` selects them with the cpu_compat unit tests.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ranks import the checks by name
import mcore_cpu_checks  # noqa: E402

from megatron_ext.runtime.testing import DistributedError, run_distributed  # noqa: E402

pytestmark = pytest.mark.dist

WORLD_SIZE = 2
# A healthy spawn takes 15-35 s on 2 cores, more on a shared, loaded machine: the total limit
# is generous. A hung collective fails much sooner: the default group gets 60 s and
# megatron's groups 1 min (`distributed_timeout_minutes=1` in mcore_cpu_checks).
TIMEOUT_S, COLLECTIVE_TIMEOUT_S = 300.0, 60.0

Outcomes = dict[str, list[str | None]] | str
"""{check: [per-rank traceback or None]}, or the harness error text if the spawn failed."""


def _spawn(fn: Callable[..., Any], **kwargs: Any) -> Outcomes:
    try:
        per_rank = run_distributed(
            fn,
            world_size=WORLD_SIZE,
            timeout_s=TIMEOUT_S,
            collective_timeout_s=COLLECTIVE_TIMEOUT_S,
            **kwargs,
        )
    except DistributedError as err:
        return str(err)
    return {name: [outcomes[name] for outcomes in per_rank] for name in per_rank[0]}


@pytest.fixture(scope="module")
def model_parallel_outcomes() -> Outcomes:
    return _spawn(mcore_cpu_checks.model_parallel_checks)


@pytest.fixture(scope="module")
def data_parallel_outcomes(tmp_path_factory: pytest.TempPathFactory) -> Outcomes:
    ckpt_dir = tmp_path_factory.mktemp("mcore_cpu_ckpt")
    return _spawn(mcore_cpu_checks.data_parallel_checks, ckpt_dir=str(ckpt_dir))


def _assert_passed(outcomes: Outcomes, check: str) -> None:
    if isinstance(outcomes, str):
        pytest.fail(f"spawn failed before {check!r} could report:\n{outcomes}", pytrace=False)
    failures = [f"--- rank {r} ---\n{tb}" for r, tb in enumerate(outcomes[check]) if tb]
    if failures:
        pytest.fail(f"{check} failed:\n" + "\n".join(failures), pytrace=False)


def test_cpu_compat_tp2_gpt_matches_tp1(model_parallel_outcomes: Outcomes) -> None:
    _assert_passed(model_parallel_outcomes, "tp2")


def test_cpu_compat_tp2_sequence_parallel_matches_tp1(model_parallel_outcomes: Outcomes) -> None:
    _assert_passed(model_parallel_outcomes, "tp2_sp")


def test_cpu_compat_pp2_1f1b_matches_pp1(model_parallel_outcomes: Outcomes) -> None:
    _assert_passed(model_parallel_outcomes, "pp2_1f1b")


def test_cpu_compat_dp2_distributed_optimizer_matches_dp1(data_parallel_outcomes: Outcomes) -> None:
    _assert_passed(data_parallel_outcomes, "dp2_distopt")


def test_cpu_compat_dist_checkpoint_round_trip(data_parallel_outcomes: Outcomes) -> None:
    _assert_passed(data_parallel_outcomes, "dist_ckpt")
