"""docs/walkthrough.md's command block, run as written in a temporary directory (4 gloo ranks).

The block is taken from the page itself (its one ```bash fence) and run by bash with `set -euo
pipefail` from a directory that holds links to the repository's examples/ and tools/, as a user
runs it from the repository root. `ITERS=12`, which the page mentions, shortens training from 30
iterations to 12 (stop at 8, resume to 12); everything else is the page's text: preprocess,
`profile hardware`, the search on the measured profile, training under the searched plan with
`megatron-ext launch`, and the resume under plain Megatron flags with the optimizer state resharded, whatever
plan the measured profile led to. Several minutes on 2 busy cores: most of it is the hardware
profile and the four torchrun starts.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
ITERATION = re.compile(r"\]  iteration +(\d+)/ +(\d+) \|.* lm loss: ([0-9.E+-]+) \|")


def _block() -> str:
    text = (REPO / "docs" / "walkthrough.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "the walk-through has one bash block"
    return blocks[0]


def test_walkthrough_runs_as_written(tmp_path: Path) -> None:
    for sub in ("examples", "tools"):
        os.symlink(REPO / sub, tmp_path / sub)
    env = {**os.environ, "PYTHONPATH": str(REPO), "ITERS": "12"}
    result = subprocess.run(["bash", "-c", "set -euo pipefail\n" + _block()], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=3000, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    walk = tmp_path / "walk"
    assert (walk / "cluster.json").is_file() and (walk / "plan.json").is_file()
    iterations = [int(m.group(1)) for m in map(ITERATION.search, result.stdout.splitlines()) if m]
    assert iterations[:2] == [5, 10], iterations  # --log-interval 5: step 4 to 8, step 5 to 12
    assert (walk / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert "megatron-ext launch: checked custom on 4 ranks" in result.stderr
    # the resume under another layout keeps the Adam state (parameter-keyed, it reshards)
    assert re.search(r"loaded ckpt/iter_0000008: weights restored.*; optimizer state restored"
                     r".*; iteration 8 and consumed samples restored", result.stdout), result.stdout
    assert "Traceback" not in output, output[-4000:]
