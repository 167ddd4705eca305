"""pretrain_gpt.py's console: flags checked before torch, one-line errors in torchrun's error file,
rank 0's log on stdout, megatron-core's dumps only with --logging-level, known warnings filtered.

The 4-rank runs under torchrun are in tests/dist/test_console_torchrun.py.
"""

from __future__ import annotations

import configparser
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.megatron_adapter.training import console
from megatron_ext.warning_filters import KNOWN_WARNINGS

REPO = Path(__file__).resolve().parents[2]
ENTRY = "from megatron_ext.megatron_adapter.training.entry import main\n"


@pytest.fixture
def root_logging() -> Iterator[None]:
    """setup_logging replaces the root handlers: put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    mcore = logging.getLogger("megatron")
    mcore_level = mcore.level
    yield
    logging.captureWarnings(False)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    mcore.setLevel(mcore_level)


def _child(code: str, *, env: dict[str, str] | None = None,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False, cwd=cwd,
                          env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO),
                               **(env or {})})


def test_flag_typo_is_reported_before_torch_is_imported() -> None:
    """The typo costs a pure-Python parse, not megatron-core's import and a process group."""
    result = _child("import sys\n" + ENTRY +
                    "code = main(['--num-layerz', '2', '--cpu'])\n"
                    "assert 'torch' not in sys.modules, 'torch was imported'\n"
                    "sys.exit(code)")
    assert result.returncode == 2, result.stderr
    assert result.stderr == ("pretrain_gpt.py: error: --num-layerz is not a Megatron flag "
                             "megatron_ext accepts; did you mean --num-layers? "
                             "(pretrain_gpt.py --help lists them)\n")


def test_missing_flags_are_reported_before_torch() -> None:
    result = _child("import sys\n" + ENTRY +
                    "code = main(['--num-layers', '2', '--hidden-size', '64', "
                    "'--num-attention-heads', '4', '--seq-length', '32', "
                    "'--max-position-embeddings', '32', '--micro-batch-size', '1', '--cpu', "
                    "'--train-iters', '2'])\n"
                    "assert 'torch' not in sys.modules, 'torch was imported'\n"
                    "sys.exit(code)")
    assert result.returncode == 2, result.stderr
    assert result.stderr == "pretrain_gpt.py: error: --lr is required\n"


def test_each_local_rank0_prints_and_writes_the_error_file(tmp_path: Path) -> None:
    """Rank 0, and local rank 0 of every other node (rank 3 on a 3-rank node here)."""
    for rank in (0, 3):
        error_file = tmp_path / f"error_{rank}.json"
        result = _child("import sys\n" + ENTRY + "sys.exit(main(['--num-layerz', '2']))",
                        env={"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "4",
                             "TORCHELASTIC_ERROR_FILE": str(error_file)})
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1, result.stderr
        assert result.stdout == ""
        # torch/distributed/elastic/multiprocessing/errors/__init__.py reads message/extraInfo
        # and shows py_callstack as the failure's "traceback".
        data = json.loads(error_file.read_text())["message"]
        assert data["extraInfo"]["py_callstack"].startswith("pretrain_gpt.py: error: --num-layerz")
        assert "\n" not in data["extraInfo"]["py_callstack"]
        assert int(data["extraInfo"]["timestamp"]) > 0


def test_other_local_ranks_defer_to_local_rank0(tmp_path: Path, capsys: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun lists every non-zero exit in its summary: a local rank whose error local rank 0
    reported exits 0 after it left its marker; one that waited for a rank 0 that reported
    something else (or nothing) reports its own error (exit 2, its error file)."""
    import threading

    for rank in (0, 1):
        (tmp_path / str(rank)).mkdir()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "1" / "error.json"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    same = json.dumps({"message": {"message": "PlanError: bad flag", "extraInfo": {
        "py_callstack": "pretrain_gpt.py: error: bad flag", "timestamp": "1"}}})
    rank0 = threading.Timer(0.5, (tmp_path / "0" / "error.json").write_text, args=(same,))
    start = time.monotonic()
    rank0.start()
    assert console.report_user_error("bad flag") == 0
    assert capsys.readouterr().err == ""  # local rank 0 prints it
    assert time.monotonic() - start >= 0.45  # waited for rank 0's file
    assert (tmp_path / "1" / "reported").read_text() == str(os.getpid())
    assert not (tmp_path / "1" / "error.json").exists()
    # Local rank 0 reported another error: this rank's own is reported.
    (tmp_path / "0" / "error.json").write_text(same.replace("bad flag", "other"))
    assert console.report_user_error("bad flag") == 2
    assert (tmp_path / "1" / "error.json").exists()
    # A rank 0 that never reports: the wait is bounded.
    (tmp_path / "0" / "error.json").unlink()
    monkeypatch.setattr(console, "RANK0_WAIT_S", 0.2)
    start = time.monotonic()
    assert console.report_user_error("bad flag") == 2
    assert 0.15 <= time.monotonic() - start < 5


def test_local_rank0_waits_until_the_other_local_ranks_are_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    for rank in (0, 1):
        (tmp_path / str(rank)).mkdir()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "0" / "error.json"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"])
    (tmp_path / "1" / "reported").write_text(str(other.pid))
    start = time.monotonic()
    try:
        assert console.report_user_error("bad flag") == 2
        waited = time.monotonic() - start
    finally:
        other.wait()
    assert 0.5 <= waited < console.RANK0_WAIT_S, waited  # until the other rank exited
    assert capsys.readouterr().err == "pretrain_gpt.py: error: bad flag\n"
    assert json.loads((tmp_path / "0" / "error.json").read_text())["message"]["extraInfo"][
        "py_callstack"] == "pretrain_gpt.py: error: bad flag"


def test_no_cpu_flag_without_cuda_is_refused_in_one_line(tmp_path: Path) -> None:
    """A Megatron-LM user without --cpu means GPUs; no silent fall-back to gloo on CPU."""
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
             "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
             "NullTokenizer", "--vocab-size", "128"]
    result = _child("import sys\n" + ENTRY + f"sys.exit(main({flags!r}))",
                    env={"CUDA_VISIBLE_DEVICES": ""}, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert "no CUDA device" in result.stderr and "--cpu" in result.stderr


def _emit_all() -> None:
    logging.getLogger("megatron_ext.x").info("ours")
    logging.getLogger("megatron.core.distributed.x").info("config dump")
    logging.getLogger("megatron.core.datasets.gpt_dataset").warning(
        "Unable to save MockGPTDataset indexes because path_to_cache is None")
    logging.getLogger("megatron_ext.x").warning("a warning")
    logging.getLogger("megatron_ext.x").error("an error")


def test_rank0_log_on_stdout_warnings_on_stderr(root_logging: None, capsys: Any) -> None:
    console.setup_logging(rank=0, level=None)
    _emit_all()
    out, err = capsys.readouterr()
    assert out.splitlines()[0].endswith("] ours") and "config dump" not in out
    assert len(out.splitlines()) == 1
    assert "WARNING megatron_ext.x: a warning" in err and "ERROR megatron_ext.x: an error" in err
    assert "path_to_cache" not in err
    assert out.startswith("[20") and out[20:22] == "] "  # [YYYY-mm-dd HH:MM:SS]: Megatron-LM's


def test_other_ranks_log_errors_only(root_logging: None, capsys: Any) -> None:
    console.setup_logging(rank=2, level=None)
    _emit_all()
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "an error" in err


def test_logging_level_shows_megatron_core_dumps_on_every_rank(root_logging: None,
                                                                capsys: Any) -> None:
    """Megatron-LM's --logging-level: the root level, on every rank (initialize.setup_logging)."""
    console.setup_logging(rank=2, level=logging.INFO)
    _emit_all()
    out, err = capsys.readouterr()
    assert "ours" in out and "config dump" in out and "path_to_cache" in err


def test_logging_level_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_ext.flags.parser import parse_megatron_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1"]
    monkeypatch.delenv("MEGATRON_LOGGING_LEVEL", raising=False)
    assert parse_megatron_args(base).logging_level is None
    assert console.logging_level(None) is None
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "10")
    assert console.logging_level(None) == 10
    explicit = parse_megatron_args([*base, "--logging-level", "20"]).logging_level
    assert console.logging_level(explicit) == 20  # the flag wins over the environment


def test_known_warnings_filtered_and_cover_pytest_ini() -> None:
    ini = configparser.ConfigParser()
    ini.read(REPO / "pytest.ini")
    lines = [x.strip() for x in ini["pytest"]["filterwarnings"].splitlines() if x.strip()]
    ours = {message for message, _ in KNOWN_WARNINGS}
    for line in lines:
        _, message, _ = line.split(":", 2)
        assert message in ours, f"pytest.ini filters {message!r}; the entry point does not"
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        console.install_warning_filters()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back", UserWarning,
                      stacklevel=1)
        warnings.warn("something new", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something new"]
