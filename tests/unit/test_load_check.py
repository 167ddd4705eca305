"""tools/load_check.py: when the CPU calibration benchmark reports and when it refuses.

The decision is tested on recorded checkpoints (no timing is asserted); one check runs the real
reference loop under a busy child process and only requires that it is measured at all.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from megatron_ext.calibration import load_check

REPO = Path(__file__).resolve().parents[2]


def _log(refs_ms: list[float], loads: list[float], max_swing: float = 1.5):
    log = load_check.LoadLog(max_swing=max_swing)
    for i, (ref, load) in enumerate(zip(refs_ms, loads)):
        log.checkpoints.append(load_check.Checkpoint(
            label=f"c{i}", wall_s=10.0 * i, load_avg_1m=load, reference_s=ref / 1e3))
    return log


def test_steady_heavy_load_is_reported() -> None:
    """A CPU hog running the whole time slows profile and runs alike: comparable."""
    log = _log([80, 85, 90, 82, 88], [12.0, 14.5, 15.0, 13.2, 14.0])
    assert log.stable() and log.verdict().startswith("load steady: reference loop 80-90 ms")
    assert log.to_dict()["stable"] is True and len(log.to_dict()["checkpoints"]) == 5


def test_load_that_changes_mid_run_is_refused() -> None:
    """Quiet while profiling, busy while measuring: the swing that gave 60% errors before."""
    log = _log([30, 32, 31, 95, 97], [1.2, 1.5, 2.0, 14.0, 15.5])
    assert not log.stable()
    verdict = log.verdict()
    assert verdict.startswith("load changed during the run: reference loop 30-97 ms (3.23x)")
    assert verdict.endswith("not comparable, figures not reported") and "\n" not in verdict
    assert not log.to_dict()["stable"]
    # The threshold is the caller's: a looser one accepts the same run.
    assert _log([30, 32, 31, 95, 97], [1.0] * 5, max_swing=4.0).stable()


def test_table_lists_every_checkpoint() -> None:
    table = _log([30, 40], [1.0, 2.0]).table().splitlines()
    assert len(table) == 3 and table[1].split()[0] == "c0" and table[2].split()[-1] == "40.0"


def test_reference_loop_runs_beside_a_busy_process() -> None:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        log = load_check.LoadLog()
        point = log.checkpoint("with a busy process")
    finally:
        hog.kill()
        hog.wait()
    assert point.reference_s > 0 and point.load_avg_1m >= 0
