"""Load a script of tools/ as a module in a test (tools/ is a folder of scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(filename: str, name: str | None = None) -> ModuleType:
    """tools/`filename` as module `name` (default: the file's stem). tools/ joins sys.path, as
    when the script runs (tools import their siblings), and the module is registered under its
    name (dataclasses look their module up there)."""
    name = name or Path(filename).stem
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
