"""patches/: each diff of the installed megatron-core's line (patches/v0.16, v0.19) applies to it,
alone and together; none is stale; the line holds exactly the patches that version needs."""

from __future__ import annotations

import functools
import importlib.util
import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from megatron_ext.megatron_adapter.cpu import compat as cpu_compat

PATCH_ROOT = Path(__file__).resolve().parents[2] / "patches"
_LINE = ".".join(cpu_compat.megatron_core_version().split(".")[:2])
PATCH_DIR = PATCH_ROOT / f"v{_LINE}"
DIFFS = sorted(PATCH_DIR.glob("*.diff"))
HAVE_PATCH = shutil.which("patch") is not None


@functools.cache
def _make_diffs() -> ModuleType:
    """patches/make_diffs.py (a script, not a package module), loaded once."""
    name = "megatron_ext_patches_make_diffs"
    spec = importlib.util.spec_from_file_location(name, PATCH_ROOT / "make_diffs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


def _patch(diff: Path, root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["patch", "-p1", "--batch", "-d", str(root), "-i", str(diff), *extra],
        capture_output=True,
        text=True,
        check=False,
    )


def _touched_files(diff: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", diff.read_text(), flags=re.MULTILINE)


def test_patches_one_diff_per_runtime_patch_and_readme_lists_them() -> None:
    """This line's directory has a diff for each patch this version needs, and no other."""
    assert [d.stem for d in DIFFS] == sorted(cpu_compat.for_version())
    assert _make_diffs().PATCH_DIR == PATCH_DIR
    for line in ("v0.16", "v0.19"):  # both lines are committed, whichever is installed
        names = sorted(cpu_compat.for_version(f"{line[1:]}.0" if line == "v0.19" else "0.16.1"))
        assert sorted(d.stem for d in (PATCH_ROOT / line).glob("*.diff")) == names, line
    readme = (PATCH_ROOT / "README.md").read_text()
    for name in cpu_compat.PATCHES:
        assert f"| `{name}` |" in readme, f"README table lacks {name}"


@pytest.mark.skipif(not HAVE_PATCH, reason="`patch` is not installed")
@pytest.mark.parametrize("diff", DIFFS, ids=lambda d: d.stem)
def test_patches_dry_run_against_installed_megatron(diff: Path) -> None:
    site_packages = _make_diffs().SITE_PACKAGES
    result = _patch(diff, site_packages, "--dry-run")
    if result.returncode != 0 and _patch(diff, site_packages, "--dry-run", "-R").returncode == 0:
        pytest.skip(f"{diff.name} is already applied to this install")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(not HAVE_PATCH, reason="`patch` is not installed")
def test_patches_apply_together_and_compile(tmp_path: Path) -> None:
    site_packages = _make_diffs().SITE_PACKAGES
    touched = sorted({f for diff in DIFFS for f in _touched_files(diff)})
    for rel in touched:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(site_packages / rel, tmp_path / rel)
    for diff in DIFFS:
        result = _patch(diff, tmp_path)
        assert result.returncode == 0, f"{diff.name}:\n{result.stdout}{result.stderr}"
    for rel in touched:
        py_compile.compile(str(tmp_path / rel), doraise=True)


def test_patches_are_up_to_date_with_make_diffs() -> None:
    make_diffs = _make_diffs()
    for diff in DIFFS:
        try:
            expected = make_diffs.render(diff.stem)
        except RuntimeError as err:  # the install itself is patched or not 0.16.1
            pytest.skip(str(err))
        assert diff.read_text() == expected, f"{diff.name} is stale: run patches/make_diffs.py"
