"""Reading an output folder's own files back (manifest.json, stats.json, the Parquet files) for a
resumed run, `qbatch status`, `qbatch report` and `qbatch merge`.

The rule: a file that is there but cannot be used (not JSON, JSON of the wrong shape, a truncated
or foreign Parquet file, unreadable) is an OutputError that names the file and how to recover,
never a traceback and never taken for a missing file. The JSON files' shapes are their records'
(output/manifest.py, output/summary.py), derived from the records' fields (record_files.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qbatch._fs import read_error, read_json
from qbatch.errors import OutputError, first_line
from qbatch.output.columns import decode_schema


@dataclass(frozen=True)
class Needed:
    """A field that must be there, in `shape` (readers index it without a default)."""

    shape: Any


@dataclass(frozen=True)
class Decoded:
    """Text that `decode` turns into what readers use (it raises ValueError when it cannot): `what` names it."""

    what: str
    decode: Callable[[str], Any]


@dataclass(frozen=True)
class Values:
    """An object whose every value is in `shape` (its keys are data: flags, kinds of failure)."""

    shape: Any


# A shape: a type, a tuple of alternatives (None: null), {field: shape} for an object, [shape] for a list,
# Needed(shape) for a field that must be there, Decoded for text that must decode, Values(shape) for a mapping.
# A record's file's shape is derived from its fields (record_files.shape_of).
Shape = Any
ARROW_SCHEMA = Decoded("an Arrow schema as qbatch records it", decode_schema)
MANIFEST_HINT = ("restore it, or rerun the job with --restart to start this output over "
                 "(its finished parts are then redone)")
STATS_HINT = "delete it: the next run writes it again, and status and report work without it"
FINAL_HINT = ("rerun the same command (it resumes and writes results.parquet and errors.parquet again from "
              "parts/), or for a merge the same `qbatch merge`")
PART_HINT = "delete that part (its rows will be redone) and rerun"
TELEMETRY_HINT = "move it away: status and report work without telemetry, and the next run writes a new one"
KINDS = [(dict, "an object"), (list, "a list"), (str, "text"), (bool, "a boolean"), (int, "an integer"),
         (float, "a number")]  # bool before int: True is an int to Python, not to a reader of JSON


def read_checked(path: Path, shape: Shape, hint: str) -> dict[str, Any] | None:
    data = read_json(path, hint=hint)
    problem = None if data is None else shape_problem(data, shape, "")
    if problem is not None:
        raise OutputError(f"{path.name} is damaged: {problem}", where=str(path), hint=hint)
    checked: dict[str, Any] | None = data  # an object: the shapes are objects
    return checked


def shape_problem(value: Any, shape: Shape, field: str) -> str | None:
    """What in `value` does not have `shape` ("'counts.rows_ok' is text, not an integer"), or None."""
    if isinstance(shape, tuple):
        if any(shape_problem(value, alternative, field) is None for alternative in shape):
            return None
        return _mismatch(value, shape[0], field)
    if shape is None:
        return None if value is None else _mismatch(value, None, field)
    if isinstance(shape, Decoded):
        if not isinstance(value, str):
            return _mismatch(value, str, field)
        try:
            shape.decode(value)
        except ValueError as exc:
            return f"'{field}' is not {shape.what} ({first_line(exc, 200)})"
        return None
    if isinstance(shape, Values):
        shape = dict.fromkeys(value, shape.shape) if isinstance(value, dict) else dict
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return _mismatch(value, dict, field)
        for key, inner in shape.items():
            problem = _field_problem(value, key, inner, f"{field}.{key}".lstrip("."))
            if problem is not None:
                return problem
        return None
    if isinstance(shape, list):
        if not isinstance(value, list):
            return _mismatch(value, list, field)
        return next((p for i, item in enumerate(value) if (p := shape_problem(item, shape[0], f"{field}[{i}]"))),
                    None)
    if shape is float:
        fits = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif shape is int:
        fits = isinstance(value, int) and not isinstance(value, bool)
    else:
        fits = isinstance(value, shape)
    return None if fits else _mismatch(value, shape, field)


def _field_problem(value: dict[str, Any], key: str, shape: Shape, field: str) -> str | None:
    if isinstance(shape, Needed):
        if key not in value:
            return f"'{field}' is missing"
        shape = shape.shape
    return None if key not in value else shape_problem(value[key], shape, field)


def _mismatch(value: Any, expected: Any, field: str) -> str:
    what = f"'{field}'" if field else "the file"
    return f"{what} is {_kind(value)}, not {_kind_name(expected)}"


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for kind, name in KINDS if isinstance(value, kind)), type(value).__name__)


def _kind_name(expected: Any) -> str:
    if expected is None:
        return "null"
    if isinstance(expected, (dict, list, Values)):
        expected = list if isinstance(expected, list) else dict
    return next(name for kind, name in KINDS if kind is expected)


@contextmanager
def reading(path: Path, hint: str) -> Iterator[None]:
    """Turn a failure to read a Parquet file (or folder of parts) into an OutputError naming it."""
    import polars as pl
    import pyarrow as pa

    try:
        yield
    except OSError as exc:
        raise read_error(path, exc, hint) from None
    except (pa.ArrowException, pl.exceptions.PolarsError) as exc:
        raise OutputError(f"cannot read {path.name}: {first_line(exc, 300)}", where=str(path), hint=hint) from None
