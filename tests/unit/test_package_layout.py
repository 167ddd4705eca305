"""The package's import graph: no cycles (lazy imports inside functions count; imports under
`if TYPE_CHECKING:` do not) and imports pointing one way:

    commands -> megatron_adapter -> runtime -> planner -> geometry -> plan -> specs
             -> schema -> errors
    commands, megatron_adapter -> flags -> plan
    calibration -> flags, planner

geometry (which ranks hold which part of an activation or of the vocabulary, from the plan alone)
sits below the planner so that the planner, `evaluate` and the runtime share one answer.
Only megatron_adapter imports megatron; the planner, the geometry, the flags and the calibration
import neither torch nor megatron, so `megatron-ext search`/`args` never need them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "megatron_ext"

# A module of area A may import megatron_ext modules only of the areas listed for A.
ALLOWED = {
    "errors": set(),
    "warning_filters": set(),
    "schema": {"errors"},
    "specs": {"errors", "schema"},
    "presets": {"errors", "schema", "specs", "hf_config"},
    "hf_config": {"errors", "schema", "specs"},
    "plan": {"errors", "schema", "specs", "plan"},  # plan <-> plan_checks is type-only
    "geometry": {"errors", "schema", "specs", "plan", "geometry"},
    "planner": {"errors", "schema", "specs", "presets", "hf_config", "plan", "geometry",
                "planner"},
    "flags": {"errors", "schema", "specs", "presets", "hf_config", "plan", "flags"},
    # the cost model's calibration on published runs: builds their plans from Megatron flags
    "calibration": {"errors", "schema", "specs", "presets", "hf_config", "plan", "geometry",
                    "planner", "flags", "calibration"},
    "runtime": {"errors", "schema", "specs", "presets", "plan", "geometry", "planner",
                "runtime"},
    "megatron_adapter": {"errors", "schema", "specs", "presets", "hf_config", "plan", "geometry",
                         "planner", "flags", "runtime", "megatron_adapter", "warning_filters"},
    "commands": {"errors", "schema", "specs", "presets", "hf_config", "plan", "geometry",
                 "planner", "flags", "runtime", "megatron_adapter", "commands", "warning_filters"},
    "cli": {"errors", "schema", "warning_filters", "commands"},
    "__init__": set(),
}
NO_TORCH = ("planner", "geometry", "flags", "calibration", "plan", "specs", "schema", "errors",
            "presets", "hf_config", "warning_filters")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _area(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    area = parts[1]
    return "plan" if area == "plan_checks" else area


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str) -> list[str]:
    """Absolute names of every module imported anywhere in the file (functions included)."""
    found: list[str] = []
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.extend(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.append(base)
                found.extend(f"{base}.{alias.name}" for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for name in _imports(path, module):
            # `from pkg import submodule` names the submodule; `from mod import func` the module
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module and name.startswith("megatron_ext"):
                targets.add(name)
        graph[module] = targets
    return graph


GRAPH = _graph()
EXTERNAL = {m: _imports(p, m) for m, p in
            ((_module_name(p), p) for p in ROOT.rglob("*.py"))}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_graph_is_read():
    assert "megatron_ext.flags.parser" in GRAPH["megatron_ext.commands.args"] or any(
        m.startswith("megatron_ext.flags") for m in GRAPH["megatron_ext.commands.args"])
    assert "megatron_ext.plan_checks" in GRAPH["megatron_ext.plan"]


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_one_way(module):
    area = _area(module)
    allowed = ALLOWED[area]
    wrong = sorted(t for t in GRAPH[module] if _area(t) not in allowed and _area(t) != area)
    assert not wrong, f"{module} ({area}) imports {wrong}"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_only_the_megatron_adapter_imports_megatron(module):
    names = EXTERNAL[module]
    if _area(module) != "megatron_adapter":
        assert not [n for n in names if n == "megatron" or n.startswith("megatron.")]
    if _area(module) in NO_TORCH:
        assert not [n for n in names if n == "torch" or n.startswith("torch.")]
