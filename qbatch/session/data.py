"""In-memory data -> an input file, so a Session's job reads rows exactly as `qbatch run` does.

DataFrames (polars, pandas) and pyarrow Tables become Parquet (column types kept); lists of dicts
and of strings become JSONL (each row as given, so a bad row becomes an error row, as in a file). A
missing value (pandas' None, NaN, NaT or NA; polars' null) is a null of its row alone: a pandas
column that no one type holds goes as JSONL rows, each value its own, and a pandas column of whole
numbers that pandas made floats to hold a NaN is whole numbers again where qbatch reads integers. The file is written
only when its bytes change: a rerun with the same data on the same output folder leaves it
as it was, and the run's fingerprint (the input's size and hashes) lets it resume.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qbatch.errors import InputError, OutputError

INPUT_STEM = "input"
DATA_HINT = ("pass a path or glob, a polars or pandas DataFrame, a pyarrow Table, a list of dicts (one per row) "
             "or a list of prompt strings")


def input_paths(data: Any, folder: Path) -> list[str]:
    """The job's `inputs` for `data`: its own paths, or a file written into `folder`."""
    if isinstance(data, str) and not _names_files(data):
        raise InputError("a string is the path or glob of input files, and no file matches it", where=data[:80],
                         hint="pass a list of strings for prompts or texts: run([text]), embed([text])")
    if isinstance(data, (str, os.PathLike)):
        return [os.fspath(data)]
    if _is_frame(data):
        return [_frame_input(data, folder)]
    if isinstance(data, Sequence) and not isinstance(data, (bytes, bytearray)):
        return _sequence_inputs(list(data), folder)
    raise InputError(f"cannot read data of type {type(data).__name__}", hint=DATA_HINT)


def _names_files(text: str) -> bool:
    """Whether a string names input files: a path that exists, a glob that matches, or standard input."""
    import glob

    path = os.path.expanduser(text)
    return text == "-" or os.path.exists(path) or bool(glob.glob(path, recursive=True))


def _sequence_inputs(items: list[Any], folder: Path) -> list[str]:
    if not items:
        raise InputError("no rows given", hint=DATA_HINT)
    if all(isinstance(item, os.PathLike) for item in items):
        return [os.fspath(item) for item in items]
    if all(isinstance(item, str) for item in items):
        # Prompts get their position as id: results and errors name the prompt they belong to.
        items = [{"id": str(i), "prompt": text} for i, text in enumerate(items)]
    elif not all(isinstance(item, dict) for item in items):
        kinds = sorted({type(item).__name__ for item in items})
        raise InputError(f"a list of rows must hold only dicts or only strings, got {', '.join(kinds)}",
                         hint=DATA_HINT)
    return [_write(folder / f"{INPUT_STEM}.jsonl", _jsonl_bytes(items))]


def _is_frame(data: Any) -> bool:
    """A polars or pandas DataFrame, a polars LazyFrame or a pyarrow Table (checked by module: importing
    pandas costs ~0.5 s)."""
    module, name = type(data).__module__.split(".")[0], type(data).__name__
    return (module in ("polars", "pandas") and name in ("DataFrame", "LazyFrame")) or (module, name) == ("pyarrow", "Table")


def _frame_input(data: Any, folder: Path) -> str:
    """A frame as the input file: Parquet, or JSONL rows for a pandas frame no Parquet types hold."""
    import polars as pl

    if isinstance(data, pl.LazyFrame):
        data = data.collect()
    elif type(data).__module__.startswith("pyarrow"):
        data = pl.from_arrow(data)
    elif not isinstance(data, pl.DataFrame):  # pandas
        data = _from_pandas(data)
        if isinstance(data, list):
            return _write(folder / f"{INPUT_STEM}.jsonl", _jsonl_bytes(data))
    buffer = io.BytesIO()
    data.write_parquet(buffer, compression="zstd", statistics=False)
    return _write(folder / f"{INPUT_STEM}.parquet", buffer.getvalue())


def _from_pandas(frame: Any) -> Any:
    """A polars DataFrame of a pandas one (missing values as nulls), or its rows as dicts when a column holds
    values of several types (a prompt column of text and a number: the number is that row's error)."""
    import polars as pl

    frame = _whole_numbers(_index_as_columns(frame))
    _check_column_names(list(frame.columns))
    try:
        return pl.from_pandas(frame)
    except Exception:  # object columns polars cannot type (mixed values): each row as it is, as JSONL lines
        return [{key: None if _missing(value) else value for key, value in row.items()}
                for row in frame.to_dict(orient="records")]


def _whole_numbers(frame: Any) -> Any:
    """Columns qbatch reads as integers (max_tokens, seed, n, ...) that pandas turned into floats to hold a
    missing value, as whole numbers again: a NaN in one row must not make every other row's 5 a 5.0."""
    from qbatch.sampling import INT_PARAMS

    for name in INT_PARAMS:
        column = frame.get(name)
        if column is not None and column.dtype.kind == "f" and column.isna().any():
            values = column.dropna()
            if (values == values.round()).all():
                frame = frame.assign(**{name: column.astype("Int64")})
    return frame


def _missing(value: Any) -> bool:
    """pandas' missing values (None, NaN, NaT, NA), for one cell; a list or dict is a value."""
    import pandas as pd

    return value is None or (not isinstance(value, (list, dict, tuple)) and bool(pd.isna(value)) is True)


def _index_as_columns(frame: Any) -> Any:
    """A pandas index that says something (a name, or labels other than the positions 0..n-1) becomes
    columns, carried to the results as the frame's other columns are (an index named `id` is then the
    rows' id); the default index is the rows' positions, which the results hold already (row_index)."""
    import pandas as pd

    index = frame.index
    if isinstance(index, pd.RangeIndex) and index.start == 0 and index.step == 1 and index.name is None:
        return frame
    try:
        return frame.reset_index()
    except ValueError as exc:  # "cannot insert NAME, already exists"
        raise InputError(f"the DataFrame's index and one of its columns share a name: {exc}",
                         hint="rename one of them, or frame.reset_index(drop=True) to leave the index out") from None


def _check_column_names(names: list[Any]) -> None:
    """Each column is one field of a row: it needs a name of its own, as text."""
    for name in names:
        if not isinstance(name, str):
            raise InputError(f"DataFrame column names must be text, got {name!r} ({type(name).__name__})",
                             hint="frame.columns = frame.columns.astype(str)")
    doubled = sorted({name for name in names if names.count(name) > 1})
    if doubled:
        raise InputError(f"the DataFrame has several columns named {doubled[0]!r}",
                         hint="rename them: each column becomes one field of a row")


def _jsonl_bytes(rows: list[dict[str, Any]]) -> bytes:
    import orjson

    lines = []
    for index, row in enumerate(rows):
        try:
            lines.append(orjson.dumps(row, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY))
        except TypeError as exc:
            lines.append(_escaped_json(row, index, exc))
    return b"\n".join(lines) + b"\n"


def _escaped_json(row: dict[str, Any], index: int, error: TypeError) -> bytes:
    """A row orjson refuses, as json writes it: text that is not Unicode (a lone surrogate) becomes its
    escape, which the reader turns into that row's own error (bad_text) instead of failing the call."""
    try:
        return json.dumps(row, ensure_ascii=True).encode()
    except (TypeError, ValueError):
        raise InputError(f"row {index} cannot be written as JSON: {error}",
                         hint="give rows of strings, numbers, lists and dicts") from None


def _write(path: Path, content: bytes) -> str:
    """Write `content` to `path` unless it holds it already; the path as a string."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not (path.is_file() and path.stat().st_size == len(content) and path.read_bytes() == content):
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(content)
            os.replace(tmp, path)
    except OSError as exc:
        raise OutputError(f"cannot write the input file: {exc.strerror}", where=str(path.parent),
                          hint="pass an output_dir that is a writable folder") from None
    return str(path)
