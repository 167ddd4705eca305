"""One backend contract and one selector: every backend implements `Backend`, and only
training/select.py picks and builds them (the vocabulary-parallel backend extends the layerwise
one)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from megatron_ext.megatron_adapter.training.backend import Backend
from megatron_ext.megatron_adapter.training.select import BACKEND_CLASSES, BACKENDS

TRAINING = Path(__file__).resolve().parents[2] / "megatron_ext"
BACKEND_MODULES = {f"megatron_ext.megatron_adapter.training.{m}" for m in
                   ("stock_backend", "layerwise_backend", "vocab_backend", "flexsp_backend")}
# module -> the concrete backend modules it may import
MAY_IMPORT = {
    "megatron_ext.megatron_adapter.training.select": BACKEND_MODULES,
    "megatron_ext.megatron_adapter.training.vocab_backend":
        {"megatron_ext.megatron_adapter.training.layerwise_backend"},
}


def test_every_backend_implements_the_contract() -> None:
    assert BACKENDS == ("stock", "layerwise", "vocab_parallel", "flexsp")
    for name, cls in BACKEND_CLASSES.items():
        assert issubclass(cls, Backend) and cls.name == name
        assert not inspect.isabstract(cls), f"{cls.__name__} leaves an abstract method"
        assert cls.chain_format in ("megatron", "layerwise")
    assert inspect.isabstract(Backend)


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_only_the_selector_picks_a_backend() -> None:
    for path in TRAINING.rglob("*.py"):
        module = ".".join(path.relative_to(TRAINING.parent).with_suffix("").parts)
        used = _imports(path) & BACKEND_MODULES
        allowed = MAY_IMPORT.get(module, set())
        assert used <= allowed, f"{module} imports {sorted(used - allowed)}: use select.py"
