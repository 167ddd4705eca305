"""Small things a user meets first: search flags, help, wording, number formats, --plot, pytest.ini.

Each test reproduces what a user saw (issue 16, item 6) and checks the new behaviour.
"""

from __future__ import annotations

import configparser
import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.cli import main
from megatron_ext.plan import ParallelPlan
from megatron_ext.planner.report import (
    format_duration,
    format_percent,
    plan_table,
    plot_layout,
)
from megatron_ext.presets import CLUSTER_PRESETS, MODEL_PRESETS

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny-gpt", "--global-batch-size", "8", "--seq-length", "32",
        "--precision", "fp32"]


def _search(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(["search", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("nodes", ["0", "-2"])
def test_search_refuses_zero_nodes_in_one_line(capsys: Any, nodes: str) -> None:
    code, out, err = _search(capsys, *TINY, "--nodes", nodes)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and f"--nodes={nodes}" in err, err


def test_search_says_one_node_not_one_nodes(capsys: Any) -> None:
    code, _, err = _search(capsys, *TINY)
    assert code == 0
    assert "(1 node," in err and "1 nodes" not in err, err
    code, _, err = _search(capsys, *TINY, "--nodes", "2")
    assert code == 0 and "(2 nodes," in err, err


def test_plot_without_matplotlib_fails_before_search_and_out(tmp_path: Path) -> None:
    """matplotlib is made unimportable in a child process (sys.modules entry None), whether or
    not this machine has it; the plan file must not be written and the search must not run."""
    out = tmp_path / "plan.json"
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from megatron_ext.cli import main\n"
            f"sys.exit(main(['search', *{TINY!r}, '--plot', 'x.png', '--out', {str(out)!r}]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, env={"PYTHONPATH": str(REPO)}, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "matplotlib" in result.stderr, result.stderr
    assert "search took" not in result.stderr and not out.exists()


def test_search_help_shows_defaults_and_presets(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        main(["search", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert re.search(r"--global-batch-size \S+ .*\(default 512\)", text), text
    assert re.search(r"--seq-length \S+ .*\(default 4096\)", text), text
    # argparse may break a preset name at its hyphen when wrapping: compare without spaces.
    joined = text.replace(" ", "")
    for name in (*MODEL_PRESETS, *CLUSTER_PRESETS):
        assert name in joined, name


def test_tiny_plan_prints_nonzero_time_and_mfu(capsys: Any, tmp_path: Path) -> None:
    """A 4-layer 64-wide model: the old table said `iteration 0.000 s ... MFU 0.0%`."""
    out = tmp_path / "plan.json"
    code, _, err = _search(capsys, *TINY, "--out", str(out))
    assert code == 0
    line = next(x for x in err.splitlines() if x.startswith("predicted: iteration"))
    assert "0.000 s" not in line and "MFU 0.0%" not in line, line
    assert re.search(r"iteration [0-9.]+ ms", line), line
    table = plan_table(ParallelPlan.load(out))
    assert "mem MiB" in table and "busy ms" in table
    busy = [row.split()[-1] for row in table.splitlines()[1:] if row[:1].isdigit()]
    assert busy and all(float(b) > 0 for b in busy), table


@pytest.mark.parametrize(("seconds", "text"), [
    (19.8012, "19.801 s"), (1.0, "1.000 s"), (0.0886, "88.6 ms"), (1.05e-4, "0.105 ms"),
    (0.0, "0.000 s"),
])
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(("fraction", "text"), [
    (0.574, "57.4%"), (0.014, "1.4%"), (0.00044, "0.044%"), (0.0, "0.0%"),
])
def test_format_percent(fraction: float, text: str) -> None:
    assert format_percent(fraction) == text


def test_plot_layout_has_title_legend_labelled_limit_and_visible_bars(
        capsys: Any, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert _search(capsys, *TINY, "--out", str(out))[0] == 0
    plan = ParallelPlan.load(out)
    layout = plot_layout(plan)
    assert "tiny-gpt" in layout.title and "GPUs" in layout.title and "predicted" in layout.title
    assert {name for _, name in layout.legend} == {s.describe() for s in plan.layers}
    assert len(layout.layer_colors) == plan.model.num_layers
    # A few MiB against an 80 GiB GPU: the bars set the scale, the limit is labelled off scale.
    assert layout.memory_unit == "MiB" and layout.memory_limit == 80 * 1024
    assert "memory per GPU" in layout.memory_limit_label
    assert "off scale" in layout.memory_limit_label
    assert max(layout.stage_memory) >= 0.5 * layout.memory_ylim
    assert layout.time_unit == "ms" and min(layout.stage_time) > 0
    # A plan that fills its GPUs keeps the limit on the axis.
    assert plan.prediction is not None and plan.cluster is not None
    full = dataclasses.replace(plan, prediction=dataclasses.replace(
        plan.prediction, stage_peak_memory_gib=tuple(
            0.9 * plan.cluster.memory_gib for _ in plan.stages)))
    big = plot_layout(full)
    assert big.memory_unit == "GiB" and "off scale" not in big.memory_limit_label
    assert big.memory_ylim >= plan.cluster.memory_gib


def test_plot_writes_a_png(capsys: Any, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="optional extra megatron_ext[plot]")
    png = tmp_path / "plan.png"
    assert _search(capsys, *TINY, "--plot", str(png))[0] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pytest_ini_names_only_existing_test_folders() -> None:
    text = (REPO / "pytest.ini").read_text()
    named = set(re.findall(r"tests/[\w./]+", text))
    assert named, "pytest.ini names no test folder"
    for path in named:
        assert (REPO / path.rstrip(".,;")).exists(), f"pytest.ini names {path}"
    ini = configparser.ConfigParser()
    ini.read_string(text)
    assert ini["pytest"]["testpaths"].strip() == "tests"
