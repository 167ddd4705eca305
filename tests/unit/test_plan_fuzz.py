"""Property tests: malformed and random plan files end in one clean, one-line PlanError.

Inputs are random JSON values, valid example plans with 1-3 random mutations (wrong types,
missing keys, unknown keys, negative/zero/huge ints, floats and bools for ints, nested garbage)
and random bytes on disk. Anything but PlanError (or a valid plan) fails. Example counts are
fixed and derandomized so CI is deterministic and fast.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_ext.cli import main as cli_main
from megatron_ext.errors import PlanError
from megatron_ext.plan import ParallelPlan

PLANS_DIR = Path(__file__).resolve().parents[2] / "examples" / "plans"
EXAMPLES = [json.loads(p.read_text()) for p in sorted(PLANS_DIR.glob("*.json"))]
FUZZ = settings(
    derandomize=True, deadline=None, max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Built by .map so hypothesis never repr()s a 5000-digit literal while describing the strategy.
SPECIAL_INTS = st.sampled_from(
    [(1, 0), (-1, 1), (1, 1), (3, 1), (7, 1), (2, 31), (2, 63), (-2, 63), (10, 30), (10, 5000),
     (-10, 5000)]
).map(lambda base_exp: base_exp[0] ** base_exp[1] if base_exp[1] else 0)
SCALARS = (
    st.none() | st.booleans() | st.integers() | SPECIAL_INTS
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
    | st.sampled_from(["tp", "vocab_parallel", "full", "selective", "bf16", "rope", ""])
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=16,
)


def _slots(value: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key) pair inside a JSON value, depth first."""
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for key, child in items:
        out.append((value, key))
        _slots(child, out)
    return out


@st.composite
def mutated_plans(draw: st.DrawFn) -> Any:
    plan = copy.deepcopy(draw(st.sampled_from(EXAMPLES)))
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(plan, [])
        container, key = draw(st.sampled_from(slots))
        old = container[key]
        how = draw(st.sampled_from(
            ["delete", "replace", "unknown_key", "int_edge", "float", "bool", "str", "wrap"]
        ))
        if how == "delete":
            del container[key]
        elif how == "unknown_key" and isinstance(old, dict):
            old[draw(st.text(min_size=1, max_size=8))] = draw(JSON_VALUES)
        elif how == "int_edge":
            container[key] = draw(SPECIAL_INTS)
        elif how == "float" and isinstance(old, int) and not isinstance(old, bool) and (
            abs(old) < 2**53
        ):
            container[key] = float(old) + draw(st.sampled_from([0.0, 0.5]))
        elif how == "bool":
            container[key] = draw(st.booleans())
        elif how == "str":
            container[key] = _to_bytes(old).decode()[:20]
        elif how == "wrap":
            container[key] = [old]
        else:
            container[key] = draw(JSON_VALUES)
    return plan


def _to_bytes(data: Any) -> bytes:
    try:
        return json.dumps(data).encode()
    except ValueError:  # an int past Python's 4300-digit str limit: write one by hand
        return b'{"schema_version": 1, "pp": ' + b"9" * 5000 + b"}"
    except RecursionError:
        return b"[" * 5000


def _assert_clean(data: Any) -> ParallelPlan | None:
    try:
        plan = ParallelPlan.from_dict(data)
    except PlanError as err:
        message = str(err)
        assert message and "\n" not in message, repr(message)
        return None
    # A mutation that kept the plan valid must still round-trip through JSON.
    assert ParallelPlan.from_dict(json.loads(plan.to_json())) == plan
    return plan


@FUZZ
@given(JSON_VALUES)
def test_random_json_values_raise_only_plan_error(data: Any) -> None:
    _assert_clean(data)


@FUZZ
@given(mutated_plans())
def test_mutated_example_plans_raise_only_plan_error(data: Any) -> None:
    _assert_clean(data)


@settings(FUZZ, max_examples=60)
@given(st.binary(max_size=200) | mutated_plans().map(lambda d: _to_bytes(d)))
def test_load_and_cli_on_bad_files_exit_2_with_one_line(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        path.write_bytes(raw)
        try:
            ParallelPlan.load(path)
            valid = True
        except PlanError as err:
            assert "\n" not in str(err)
            valid = False
        for command in ("validate", "args"):
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                code = cli_main([command, str(path)])
            if not valid:
                assert code == 2, (command, stderr.getvalue())
                lines = stderr.getvalue().splitlines()
                assert len(lines) == 1 and lines[0].startswith("megatron-ext: error: "), lines


def test_bad_files_through_the_cli(tmp_path: Path, capsys: Any) -> None:
    """A fixed list of classic mistakes, each exit 2 with one stderr line naming the problem."""
    good = copy.deepcopy(EXAMPLES[0])
    missing_model = {k: v for k, v in good.items() if k != "model"}
    cases = {
        "missing.json": None,
        "dir": "DIR",
        "empty.json": b"",
        "list.json": b"[1, 2]",
        "latin1.json": b"\xff\xfe{}",
        "deep.json": b"[" * 50_000,
        "bigint.json": b'{"schema_version": ' + b"9" * 5000 + b"}",
        "nomodel.json": json.dumps(missing_model).encode(),
    }
    expected = {
        "missing.json": "cannot read plan file", "dir": "cannot read plan file",
        "empty.json": "is not valid JSON", "list.json": "must hold a JSON object, got list",
        "latin1.json": "is not UTF-8 text", "deep.json": "nests JSON too deeply",
        "bigint.json": "is not valid JSON", "nomodel.json": "model is missing",
    }
    for name, raw in cases.items():
        path = tmp_path / name
        if raw == "DIR":
            path.mkdir()
        elif raw is not None:
            path.write_bytes(raw)
        assert cli_main(["validate", str(path)]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and expected[name] in err[0], (name, err)
