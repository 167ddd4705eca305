"""Typed readers for hand-written JSON: every failure is a one-line PlanError naming the field.

Used by plan.py, specs.py and the profile readers. `path` is the dotted JSON location of the value,
e.g. `layers[3].tp`, so errors read as `layers[3].tp='2' must be an integer`.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from megatron_ext.errors import PlanError

T = TypeVar("T")
MAX_INT = 2**63 - 1
"""Largest integer magnitude the readers accept (JSON files meant for int64 consumers)."""


def load_json_file(path: str | Path, what: str) -> dict[str, Any]:
    """Read a JSON object from `path`; missing files and syntax errors become PlanError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise PlanError(f"cannot read {what} {path}: {err.strerror}; check the path") from None
    except UnicodeDecodeError as err:
        raise PlanError(
            f"{what} {path} is not UTF-8 text (byte {err.start}); give a JSON file"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanError(
            f"{what} {path} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        ) from None
    except RecursionError:
        raise PlanError(f"{what} {path} nests JSON too deeply; check the file") from None
    except ValueError as err:  # e.g. an integer literal longer than Python's 4300-digit limit
        raise PlanError(f"{what} {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


def expect_object(value: Any, path: str) -> Mapping[str, Any]:
    if value is None:
        raise PlanError(f"{path} is missing; add it as a JSON object")
    if not isinstance(value, Mapping):
        raise PlanError(f"{path} must be a JSON object, got {_show(value)}")
    return value


def expect_list(value: Any, path: str) -> list[Any]:
    if value is None:
        raise PlanError(f"{path} is missing; add it as a JSON list")
    if not isinstance(value, list):
        raise PlanError(f"{path} must be a JSON list, got {_show(value)}")
    return value


def reject_unknown(data: Mapping[str, Any], allowed: set[str] | frozenset[str], path: str) -> None:
    """Unknown keys are errors, not silently ignored: a typo must not change a layout."""
    for key in data:
        if key not in allowed:
            where = f"{path}.{key}" if path else str(key)
            hint = closest(str(key), allowed)
            raise PlanError(
                f"{where} is not a known field; "
                + (f"did you mean {hint}? " if hint else "")
                + f"allowed: {', '.join(sorted(allowed))}"
            )


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to a misspelt `name` (difflib ratio >= 0.75; case, leading
    dashes and '-' vs '_' ignored), or None when nothing is that close."""
    def norm(text: str) -> str:
        return text.lstrip("-").replace("_", "-").lower()

    by_norm = {norm(k): k for k in known}
    match = difflib.get_close_matches(norm(name), list(by_norm), n=1, cutoff=0.75)
    return by_norm[match[0]] if match else None


def get_int(
    data: Mapping[str, Any], key: str, path: str, *, default: Any = ..., minimum: int | None = None
) -> int:
    value = _get(data, key, path, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{_at(path, key)}={_show(value)} must be an integer")
    if abs(value) > MAX_INT:
        raise PlanError(f"{_at(path, key)}={_show(value)} is out of range; use |value| < 2**63")
    if minimum is not None and value < minimum:
        raise PlanError(f"{_at(path, key)}={value} must be >= {minimum}")
    return value


def get_float(
    data: Mapping[str, Any], key: str, path: str, *, default: Any = ..., positive: bool = False
) -> float:
    value = _get(data, key, path, default)
    if not _is_number(value):
        raise PlanError(f"{_at(path, key)}={_show(value)} must be a finite number")
    if positive and value <= 0:
        raise PlanError(f"{_at(path, key)}={value} must be > 0")
    return float(value)


def get_optional_float(data: Mapping[str, Any], key: str, path: str, *,
                       positive: bool = False) -> float | None:
    """A finite number, or None when the key is absent or null."""
    return None if data.get(key) is None else get_float(data, key, path, positive=positive)


def get_float_list(data: Mapping[str, Any], key: str, path: str) -> tuple[float, ...]:
    """An optional list of finite numbers (absent means empty)."""
    items = expect_list(data.get(key, []), _at(path, key))
    return tuple(get_float({"_": v}, "_", "")
                 if _is_number(v) else _bad_number(f"{_at(path, key)}[{i}]", v)
                 for i, v in enumerate(items))


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _bad_number(path: str, value: Any) -> float:
    raise PlanError(f"{path}={_show(value)} must be a finite number")


def get_bool(data: Mapping[str, Any], key: str, path: str, *, default: Any = ...) -> bool:
    value = _get(data, key, path, default)
    if not isinstance(value, bool):
        raise PlanError(f"{_at(path, key)}={_show(value)} must be true or false")
    return value


def get_str(
    data: Mapping[str, Any],
    key: str,
    path: str,
    *,
    default: Any = ...,
    choices: tuple[str, ...] | None = None,
) -> str:
    value = _get(data, key, path, default)
    if not isinstance(value, str):
        raise PlanError(f"{_at(path, key)}={_show(value)} must be a string")
    if choices is not None and value not in choices:
        raise PlanError(f"{_at(path, key)}={value!r} must be one of {', '.join(choices)}")
    return value


def get_optional(data: Mapping[str, Any], key: str) -> Any:
    """The value, or None when the key is absent or null."""
    return data.get(key)


def _get(data: Mapping[str, Any], key: str, path: str, default: Any) -> Any:
    if key in data and data[key] is not None:
        return data[key]
    if default is ...:
        raise PlanError(f"{_at(path, key)} is missing; add it")
    return default


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    if isinstance(value, int) and value.bit_length() > 13_000:  # repr fails past 4300 digits
        return f"<{value.bit_length()}-bit integer>"
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # deeply nested or an over-long int inside
        return f"<{type(value).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."
