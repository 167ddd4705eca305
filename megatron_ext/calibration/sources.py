"""Where the calibration inputs are and how their copies are checked.

The published runs (tools/data/published_runs_a100.json: every row cites its source and quotes
it), vTrain's measured sweeps (tools/data/vtrain/) and Lucie-7B's parallelism table
(tools/data/lucie/) are development inputs kept in the repository, not package data: what an
install needs of them is the residual table they produce (planner/cost/residuals_a100.json).
The CSVs are upstream files byte for byte; `changed_copies` compares them with the git blob ids
recorded in calibration/vtrain.py and calibration/lucie.py.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from megatron_ext.errors import PlanError

DATA_DIR = Path(__file__).resolve().parents[2] / "tools" / "data"
"""The repository's calibration inputs (a checkout or an editable install has them)."""
DEFAULT_DATA = str(DATA_DIR / "published_runs_a100.json")
"""The published A100 runs (`about` in the file says what it holds)."""
FP8_DATA = str(DATA_DIR / "published_runs_fp8.json")
"""The published FP8 runs on H100 / GB200 / GB300 (same schema, read by load_published):
`python tools/bench_published.py --data` this file `--no-vtrain --no-lucie`."""


def load_published(path: str | Path = DEFAULT_DATA) -> list[dict[str, Any]]:
    """The rows of a published-runs file."""
    return json.loads(Path(path).read_text())["rows"]


def load_out_of_memory(path: str | Path = DEFAULT_DATA) -> list[dict[str, Any]]:
    """The layouts a published-runs file reports as out of memory (`out_of_memory`: the
    fields of a row without the measured ones); none where it has no such key."""
    return list(json.loads(Path(path).read_text()).get("out_of_memory", []))


def git_blob_id(data: bytes) -> str:
    """The id git gives a file's bytes (`git hash-object`): equal ids, equal files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def csv_number(path: Path, lineno: int, name: str, text: str, *, fix: str, integral: bool,
               minimum: int = 1) -> float | int:
    """One numeric CSV field: a positive number, or an integer >= `minimum`; otherwise a
    one-line PlanError naming the file, line, field and value, ending in `fix`."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if integral:
        ok = math.isfinite(value) and value >= minimum and value == int(value)
        kind = "a positive integer" if minimum >= 1 else f"an integer >= {minimum}"
    else:
        ok = value > 0 and math.isfinite(value)
        kind = "a positive number"
    if not ok:
        raise PlanError(f"{path.name} line {lineno}: field {name!r} = {text!r} is not {kind}; "
                        f"{fix}")
    return int(value) if integral else value


def changed_copies(directory: Path, blobs: dict[str, str]) -> list[str]:
    """The files of `blobs` (name -> upstream git blob id) whose bytes in `directory` differ."""
    return [name for name, blob in blobs.items()
            if git_blob_id((Path(directory) / name).read_bytes()) != blob]
