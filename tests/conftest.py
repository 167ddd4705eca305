"""Shared pytest setup: make the repo root importable (the package need not be pip-installed).

Spawned ranks (megatron_ext.runtime.testing.run_distributed) inherit this sys.path, so they can
import both `megatron_ext` and the test module that defines the rank function.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
