"""`pip install megatron_ext` is the planner alone: a fresh virtual environment without torch or
megatron-core runs search, evaluate, args, plan-from-args, flags and validate on README's examples.

The environment is a plain `python -m venv` (no system site-packages, so nothing of the test's own
environment leaks in); numpy and scipy come from the package registry at the versions the test
runs with (pip's cache usually has them), and the package is built from a copy of setup.py and
megatron_ext/ with `--no-deps`, so torch cannot arrive by a dependency either. The installed
metadata is then checked: only numpy and scipy are unconditional requirements, and the `train`
extra asks megatron-core for the supported range. ~20-40 s, most of it pip.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from megatron_ext.megatron_adapter.compat_versions import SUPPORTED_RANGE
from tests.doc_excerpts import README_PLAN_FLAGS

ROOT = Path(__file__).resolve().parents[2]
PLANS = ROOT / "examples" / "plans"
# README's plan-from-args example (docs/cli.md spells out its elided flags)
MEGATRON_FLAGS = README_PLAN_FLAGS.split()


def _pip(python: Path, *args: str) -> None:
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"pip install {' '.join(args)} failed:\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def planner_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bin/ of a fresh venv holding numpy, scipy and megatron_ext, nothing else."""
    base = tmp_path_factory.mktemp("planner_only")
    env_dir = base / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    _pip(python, "--no-deps", f"numpy=={importlib.metadata.version('numpy')}",
         f"scipy=={importlib.metadata.version('scipy')}")
    source = base / "src"
    source.mkdir()
    shutil.copy(ROOT / "setup.py", source / "setup.py")
    shutil.copytree(ROOT / "megatron_ext", source / "megatron_ext",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _pip(python, "--no-deps", str(source))
    return env_dir / "bin"


def _run(bin_dir: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([str(bin_dir / "megatron-ext"), *argv], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def test_the_environment_has_no_torch_and_no_megatron(planner_env: Path, tmp_path: Path) -> None:
    probe = ("import importlib.util, json, megatron_ext; print(json.dumps({m: importlib.util."
             "find_spec(m) is not None for m in ('torch', 'megatron', 'tokenizers', "
             "'transformers')} | {'file': megatron_ext.__file__}))")
    done = subprocess.run([str(planner_env / "python"), "-c", probe], capture_output=True,
                          text=True, cwd=tmp_path, env={"PATH": os.environ.get("PATH", "")})
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert str(planner_env.parent) in found.pop("file")  # the installed copy, not the checkout
    assert found == dict.fromkeys(found, False)


def test_only_numpy_and_scipy_are_required_and_train_asks_for_a_range(planner_env: Path) -> None:
    probe = "import importlib.metadata, json; print(json.dumps(importlib.metadata.requires(" \
            "'megatron_ext')))"
    # cwd: not the repository, whose megatron_ext.egg-info (an editable install) would be found
    done = subprocess.run([str(planner_env / "python"), "-c", probe], capture_output=True,
                          text=True, env={"PATH": os.environ.get("PATH", "")}, cwd=planner_env)
    requires = json.loads(done.stdout)
    unconditional = sorted(r.split(">")[0].split("=")[0] for r in requires if ";" not in r)
    assert unconditional == ["numpy", "scipy"]
    train = [r.replace(" ", "") for r in requires if 'extra=="train"' in r.replace(" ", "")]
    core = [r.split(";")[0] for r in train if r.startswith("megatron-core")]
    assert len(core) == 1 and "==" not in core[0], core
    # the extra's range is compat_versions.SUPPORTED_RANGE, whatever order setuptools writes
    assert sorted(core[0][len("megatron-core"):].split(",")) == sorted(SUPPORTED_RANGE.split(","))
    assert any(r.startswith("torch") for r in train)


def test_planner_commands_run_without_torch(planner_env: Path, tmp_path: Path) -> None:
    hetero = str(PLANS / "llama2-7b_hetero_pp2.json")
    done = _run(planner_env, "search", "--out", "searched.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--tensor-model-parallel-size" in done.stdout
    done = _run(planner_env, "validate", "searched.json", cwd=tmp_path)
    assert done.returncode == 0 and "valid plan for llama2-7b" in done.stderr, done.stderr
    done = _run(planner_env, "evaluate", hetero, "--json", "ev.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "ev.json").read_text())
    done = _run(planner_env, "args", str(PLANS / "gpt3-1.3b_tp2_pp4_layout.json"), cwd=tmp_path)
    assert done.returncode == 0 and "--pipeline-model-parallel-layout" in done.stdout, done.stderr
    done = _run(planner_env, "plan-from-args", "--world-size", "16", "--out", "mine.json", "--",
                *MEGATRON_FLAGS, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = _run(planner_env, "validate", "mine.json", cwd=tmp_path)
    assert done.returncode == 0 and "on 16 ranks" in done.stderr, done.stderr
    done = _run(planner_env, "flags", "num-experts", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("--num-experts: honoured"), done.stdout
    # no megatron-core installed: the newest flag catalog, shipped as package data
    done = _run(planner_env, "flags", cwd=tmp_path)
    assert done.returncode == 0 and " Megatron-LM core_v0.19.0 flags: " in done.stdout, done.stderr
    done = _run(planner_env, "args", "--megatron-version", "0.16.1", "searched.json", cwd=tmp_path)
    assert done.returncode == 0 and "--micro-batch-size" in done.stdout, done.stderr
    done = _run(planner_env, "validate", hetero, cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_a_runtime_command_says_what_to_install(planner_env: Path, tmp_path: Path) -> None:
    done = _run(planner_env, "profile", "model", "--model", "tiny-llama", "--out", "m.json",
                cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "megatron_ext[train]" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr

