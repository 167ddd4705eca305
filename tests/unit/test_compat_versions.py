"""The runtime refuses a megatron-core outside compat_versions.SUPPORTED_RANGE in one line,
before torch and any process group; setup.py's `train` extra asks for the same range."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.cli import main as cli_main
from megatron_ext.errors import PlanError
from megatron_ext.megatron_adapter import compat_versions
from megatron_ext.megatron_adapter.compat_versions import (
    SUPPORTED_RANGE,
    check_megatron_core,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["0.16.1", "0.16.2", "0.16.3rc0", "0.17.0", "0.19.0",
                                     "0.19.2"])
def test_supported_versions_pass(version: str) -> None:
    assert check_megatron_core(version) == version


@pytest.mark.parametrize("version", ["0.15.3", "0.16.0", "0.20.0rc1", "0.20.0", "0.21.1",
                                     "1.0.0", "main"])
def test_unsupported_versions_are_one_line_naming_version_and_range(version: str) -> None:
    with pytest.raises(PlanError) as err:
        check_megatron_core(version)
    message = str(err.value)
    assert "\n" not in message
    assert f"megatron-core {version} is installed" in message
    assert f"megatron-core{SUPPORTED_RANGE}" in message


def test_no_megatron_core_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat_versions, "installed_megatron_core", lambda: None)
    with pytest.raises(PlanError, match=r"megatron-core is not installed; .*megatron_ext\[train\]"):
        check_megatron_core()


def test_the_installed_version_is_read_from_package_metadata() -> None:
    import importlib.metadata

    assert compat_versions.installed_megatron_core() == importlib.metadata.version("megatron-core")
    check_megatron_core()  # this environment's megatron-core is a supported one


def test_setup_train_extra_asks_for_the_supported_range() -> None:
    tree = ast.parse((REPO / "setup.py").read_text())
    train = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "TRAIN" for t in node.targets))
    requirements = ast.literal_eval(train)
    assert f"megatron-core{SUPPORTED_RANGE}" in requirements


def test_pretrain_gpt_stops_before_torch_on_an_unsupported_version() -> None:
    code = ("import sys\n"
            "from megatron_ext.megatron_adapter import compat_versions\n"
            "compat_versions.installed_megatron_core = lambda: '0.15.3'\n"
            "from megatron_ext.megatron_adapter.training.entry import main\n"
            "code = main(['--num-layers', '2', '--hidden-size', '64', '--num-attention-heads', "
            "'4', '--seq-length', '32', '--max-position-embeddings', '32', '--micro-batch-size', "
            "'1', '--lr', '1e-3', '--train-iters', '2', '--cpu'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env={"PATH": os.environ.get("PATH", ""),
                                              "PYTHONPATH": str(REPO)})
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"pretrain_gpt.py: error: megatron-core 0.15.3 is installed; "
                             f"megatron_ext's runtime supports megatron-core{SUPPORTED_RANGE}: "
                             f"pip install 'megatron_ext[train]' "
                             f"(megatron-core{SUPPORTED_RANGE})\n")


def test_profile_model_stops_on_an_unsupported_version(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(compat_versions, "installed_megatron_core", lambda: "0.20.1")
    code = cli_main(["profile", "model", "--model", "tiny-llama", "--out",
                     str(tmp_path / "m.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-ext: error: megatron-core 0.20.1 is installed")
    assert not (tmp_path / "m.json").exists()


def test_every_feature_runs_on_0_19() -> None:
    import argparse

    from megatron_ext.megatron_adapter.compat_versions import check_version_features

    moe = argparse.Namespace(num_experts=8, multi_latent_attention=False)
    mla = argparse.Namespace(num_experts=None, multi_latent_attention=True)
    dense = argparse.Namespace(num_experts=None, multi_latent_attention=False)
    for args in (moe, mla, dense):
        check_version_features(args, "0.16.1")
        check_version_features(args, "0.19.2")  # MoE and MLA parity hold on 0.19 (leg 2)


def test_features_not_yet_verified_on_0_19_are_refused_in_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal machinery (NOT_YET_ON_0_19 is empty now: an entry is patched in)."""
    import argparse

    monkeypatch.setattr(compat_versions, "NOT_YET_ON_0_19", (
        ("multi_latent_attention", "--multi-latent-attention", "an unverified feature"),))
    mla = argparse.Namespace(num_experts=None, multi_latent_attention=True)
    dense = argparse.Namespace(num_experts=None, multi_latent_attention=False)
    compat_versions.check_version_features(mla, "0.16.1")  # verified there: nothing raised
    compat_versions.check_version_features(dense, "0.19.2")
    with pytest.raises(PlanError, match="^--multi-latent-attention: not supported") as err:
        compat_versions.check_version_features(mla, "0.19.2")
    assert "\n" not in str(err.value) and "0.16.1" in str(err.value)
