"""A run that fails while megatron-core's checkpoint results queue is still starting exits.

`pretrain_gpt.py --save` starts that queue (a spawn-context Manager) in a background thread at
startup (checkpoint.prewarm_checkpoint_writer). A run that then failed (a bad model config, a
rank error) used to hang at interpreter exit instead of exiting: multiprocessing's exit handler
joined the Manager process, whose shutdown finalizer was not registered yet. The failure comes
at 0.5-4 s after the prewarm started in the script below; each delay hung before the fix.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, time
from megatron_ext.megatron_adapter.training.checkpoint import prewarm_checkpoint_writer
if __name__ == "__main__":
    prewarm_checkpoint_writer()
    time.sleep(float(sys.argv[1]))
    raise SystemExit("failed while building the model")
"""


@pytest.mark.parametrize("fail_after_s", [0.5, 3.0])
def test_failure_after_the_prewarm_exits_with_its_error(tmp_path: Path,
                                                        fail_after_s: float) -> None:
    script = tmp_path / "fail_after_prewarm.py"
    script.write_text(SCRIPT)
    try:  # the Manager imports torch on start: ~10 s alone, more on a loaded machine
        result = subprocess.run([sys.executable, str(script), str(fail_after_s)], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung at exit after its error (multiprocessing joined the "
                    "results queue's Manager)")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "failed while building the model" in result.stderr
