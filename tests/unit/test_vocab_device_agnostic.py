"""The vocabulary-parallel runtime has one code path for every device and backend.

The CPU tests (tests/dist/test_vocab_*.py, tests/dist/test_training_vocab.py) can only vouch
for a GPU run if the code they run is the code a GPU run takes. These checks read the source of
every vocabulary runtime module (runtime/vocab/, megatron_adapter/vocab/; the pass planning in
planner/vocab/ and the vocabulary split in geometry/ import no torch, tests/unit/
test_package_layout.py) and fail on anything that could make the two differ: a test of the
device or backend type, a CUDA-only API, worker threads (which would need per-thread streams on
a device), or a collective issued synchronously by the passes. tests/dist/test_vocab_passes.py
runs the passes and records the collectives they issue.

This is not a GPU test: nothing here has run on a GPU (docs/vocab-parallel.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "megatron_ext"
MODULES = sorted([*(ROOT / "runtime" / "vocab").glob("*.py"),
                  *(ROOT / "megatron_adapter" / "vocab").glob("*.py")])
BACKEND_NAMES = {"cpu", "cuda", "xpu", "mps", "hip", "npu", "gloo", "nccl", "xccl", "mpi"}
BACKEND_QUERIES = {"get_backend", "is_nccl_available", "is_gloo_available", "is_available",
                   "current_accelerator", "device_count", "is_initialized"}
BANNED_NAMES = {"ThreadPoolExecutor", "ProcessPoolExecutor", "Thread", "Stream", "Event",
                "StreamContext", "stream"}
COLLECTIVES = {"broadcast", "all_reduce", "_all_gather", "all_gather_into_tensor",
               "all_gather_single", "reduce_scatter_tensor", "all_to_all_single"}


def device_branches(source: str) -> list[str]:
    """Places where `source` could behave differently per device or backend."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute):
            if node.attr in ("is_cuda", "is_cpu", "is_xpu", "is_mps", "record_stream"):
                found.append(f"{where}: .{node.attr}")
            if node.attr == "type" and "device" in ast.unparse(node.value):
                found.append(f"{where}: {ast.unparse(node)}")
            if isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr in (
                    "cuda", "xpu", "mps", "npu", "accelerator"):
                found.append(f"{where}: torch.{node.attr}")
            if node.attr in BACKEND_QUERIES | BANNED_NAMES:
                found.append(f"{where}: .{node.attr}")
        if isinstance(node, ast.Name) and node.id in BANNED_NAMES:
            found.append(f"{where}: {node.id}")
        if isinstance(node, ast.Compare):
            for const in ast.walk(node):
                if isinstance(const, ast.Constant) and isinstance(const.value, str) and (
                        const.value.lower() in BACKEND_NAMES):
                    found.append(f"{where}: compares with {const.value!r}")
        if isinstance(node, ast.ImportFrom) and node.module in ("concurrent.futures",
                                                               "torch.cuda", "torch.accelerator"):
            found.append(f"{where}: from {node.module} import ...")
    return found


def sync_collectives(source: str) -> list[str]:
    """Collective calls without `async_op=True` (they would block the caller on gloo and
    order nothing on a device)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
            node.func, "id", "")
        if name not in COLLECTIVES:
            continue
        flag = [k.value for k in node.keywords if k.arg == "async_op"]
        if not (flag and isinstance(flag[0], ast.Constant) and flag[0].value is True):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_the_checks_catch_what_they_look_for() -> None:
    """The checks can fail: the refusal this runtime had, a per-device stream, a thread pool,
    a blocking collective."""
    assert device_branches('if self.device.type != "cpu":\n    raise NotImplementedError')
    assert device_branches("s = torch.cuda.Stream()")
    assert device_branches("from concurrent.futures import ThreadPoolExecutor")
    assert device_branches('if dist.get_backend(group) == "nccl":\n    pass')
    assert device_branches("if x.is_cuda:\n    pass")
    assert sync_collectives("dist.all_reduce(t, group=g)")
    assert sync_collectives("dist.broadcast(t, group=g, group_src=0, async_op=False)")
    assert not sync_collectives("dist.all_reduce(t, group=g, async_op=True)")
    assert not device_branches("buffer = torch.empty(shape, device=self.device)")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_device_or_backend_branch(path: Path) -> None:
    assert device_branches(path.read_text()) == []


def test_every_collective_of_the_passes_is_asynchronous() -> None:
    source = (ROOT / "runtime" / "vocab" / "passes.py").read_text()
    assert sync_collectives(source) == []
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and getattr(
        n.func, "attr", getattr(n.func, "id", "")) in COLLECTIVES]
    assert len(calls) >= 3  # broadcast, all-reduce, all-gather: the check saw them


def test_modules_are_all_checked() -> None:
    names = {p.name for p in MODULES}
    assert {"passes.py", "comm.py", "iteration.py", "schedule.py", "output_layer.py"} <= names
