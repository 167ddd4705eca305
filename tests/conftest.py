"""Shared pytest setup: make the repo root importable (the package need not be pip-installed).

Ranks started by megatron_ext.runtime.testing.run_distributed inherit this sys.path, so they can
import both `megatron_ext` and the test module that defines the rank function.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Ranks of run_distributed fork from one server that has imported torch and megatron-core once:
# a fresh interpreter per rank re-imports them (~7 s of CPU per rank: a third of the 4-rank
# parity runs' time on the 2-core CI machine).
from megatron_ext.runtime.testing import preload  # noqa: E402

preload("torch", "megatron.core")
