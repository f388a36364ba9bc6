"""Readers: JSONL and JSON arrays of objects (plain, .gz, .zst) and Parquet files, streamed as `Row`s.

Nothing is read whole: JSONL goes line by line, a JSON array element by element, Parquet in record batches.
A line that cannot be parsed becomes a `Row` with an error (or stops the run
with `--on-bad-line error`), so every line is accounted for. A row whose text
is not Unicode keeps its data and fails alone (text.py), whatever --on-bad-line says.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, overload

from qbatch._fs import OUTPUT_LOCK
from qbatch.errors import InputError
from qbatch.inputs.compressed import compressed_error, open_input
from qbatch.inputs.json_array import ArrayError, array_elements, starts_array
from qbatch.inputs.text import SURROGATE_ESCAPE, column_not_utf8, escaped, is_text, lone_surrogate, not_utf8
from qbatch.log import log
from qbatch.records import Row
from qbatch.spec import COMPRESSED_SUFFIXES

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

try:  # parses a typical line several times faster than json (the input is parsed twice: pre-scan and run)
    from orjson import JSONDecodeError as FastJSONError, loads as orjson_loads

    fast_loads: Callable[[bytes], Any] | None = orjson_loads
except ImportError:  # json alone gives the same rows
    fast_loads = None

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")  # a file named as input
FOLDER_SUFFIXES = (".jsonl", ".ndjson", ".parquet")  # a folder's files (other JSON files there are no rows)
HUGE_FLOAT = float(2**63)  # orjson reads integers beyond 64 bits as floats; json keeps them exact
PARQUET_BATCH_ROWS = 4096
BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which Windows tools write at the start of a file
TAIL_BLOCK_BYTES = 1 << 16
ARRAY_HINT = "qbatch reads JSONL (one object a line), a JSON array of objects (a .json file) and Parquet"


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Turn files, folders and globs into a sorted, de-duplicated list of files, as `stable_path`s.

    A folder gives its files of the documented suffixes. Folders and globs leave out the files of
    qbatch output folders (parts, results, manifest: no inputs), so that an input folder may hold
    the output folder and a rerun reads what the first run read. A file named as such is taken.
    """
    if not inputs:
        raise InputError("no input files given", hint="pass files, folders or globs: `qbatch run prompts.jsonl -o out/`")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if any(ch in item for ch in "*?["):
            matches = _not_output(sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file()), item)
            if not matches:
                raise InputError("no files match the pattern", where=item)
            files.extend(matches)
        elif path.is_dir():
            matches = _not_output(sorted(p for p in path.rglob("*") if p.is_file() and _folder_format(p)), item)
            if not matches:
                raise InputError("folder holds no .jsonl/.ndjson/.parquet files", where=item)
            files.extend(matches)
        elif path.exists():
            files.append(path)
        else:
            raise InputError("input file not found", where=item, hint="check the path; globs must be quoted")
    for file in files:
        if not is_text(str(file)):
            raise InputError("the input's file name is not valid UTF-8: results could not name their source",
                             where=escaped(str(file)), hint="rename the file")
    seen: set[Path] = set()
    unique = []
    for file in files:
        if file.resolve() not in seen:
            seen.add(file.resolve())
            unique.append(stable_path(file))
    return unique


def _folder_format(path: Path) -> bool:
    return _name(path).endswith(FOLDER_SUFFIXES)


def _not_output(paths: list[Path], item: str) -> list[Path]:
    """The paths outside qbatch output folders (a folder that holds OUTPUT_LOCK, as every run's does)."""
    marked: dict[Path, bool] = {}

    def in_output(folder: Path) -> bool:
        if folder not in marked:
            parent = folder.parent
            marked[folder] = (folder / OUTPUT_LOCK).exists() or (parent != folder and in_output(parent))
        return marked[folder]

    kept = [p for p in paths if not in_output(p.parent.resolve())]
    if len(kept) < len(paths):
        log.info(f"{item}: {len(paths) - len(kept)} files of qbatch output folders are not inputs")
    return kept


def stable_path(path: Path) -> Path:
    """The file's folder resolved, then its own name: the same for every working directory and
    spelling, so the `source` of a resumed run's rows is one value. The name is kept as given
    (not a link's target): positional row ids are built from it."""
    return path.parent.resolve() / path.name


@overload
def detect_format(path: Path, override: str | None, *, strict: Literal[True] = True) -> str: ...


@overload
def detect_format(path: Path, override: str | None, *, strict: bool) -> str | None: ...


def detect_format(path: Path, override: str | None, *, strict: bool = True) -> str | None:
    """'jsonl' or 'parquet' from `--format` or the file name (None, unless `strict`, for neither)."""
    if override:
        return override
    name = _name(path)
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if strict:
        raise InputError(
            "cannot tell the file's format from its name",
            where=str(path),
            hint="name it .jsonl/.ndjson/.parquet (optionally .gz/.zst) or pass --format jsonl|parquet",
        )
    return None


def read_rows(files: list[Path], *, fmt: str | None = None, on_bad_line: str = "error",
              sizes: list[int | None] | None = None) -> Iterator[Row]:
    """All rows of all files, in order; with `sizes`, a JSONL file's rows in its first that many bytes
    (`rows_size`, what the run's fingerprint hashed: rows appended meanwhile are the next run's)."""
    for source_index, path in enumerate(files):
        kind = detect_format(path, fmt)
        if kind == "parquet":
            yield from _read_parquet(path, source_index)
        else:
            yield from _read_jsonl(path, source_index, on_bad_line, sizes[source_index] if sizes else None)


def rows_size(path: Path) -> int:
    """The bytes of an uncompressed JSONL file that hold rows now: up to its last newline, and a last
    line without one when it is complete JSON (a final row, as a one-off file may end). A last line
    that is not complete JSON is one a writer is still writing: it is left for a later run (logged),
    which reads it once it ends, as rows appended to the file."""
    if is_json_array(path):  # an array grows inside its brackets: any change is a changed input
        return path.stat().st_size
    with open(path, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        end = _after_last_newline(handle, size)
        if end == size:
            return size
        handle.seek(end)
        tail = handle.read(size - end)
    if not tail.strip() or _parse_line(tail.removeprefix(BOM) if end == 0 else tail)[0] is not None:
        return size
    log.warning(f"the last line of {path} has no newline and is not complete JSON (a writer may still be "
                "writing it): it is left for the next run")
    return end


def _after_last_newline(handle: IO[bytes], size: int) -> int:
    """The offset just after the file's last newline (0: it has none), read from the end."""
    end = size
    while end > 0:
        start = max(0, end - TAIL_BLOCK_BYTES)
        handle.seek(start)
        found = handle.read(end - start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        end = start
    return 0


def _read_jsonl(path: Path, source_index: int, on_bad_line: str, size: int | None) -> Iterator[Row]:
    if is_json_array(path):
        yield from _read_array(path, source_index, on_bad_line)
        return
    with open_input(path) as handle:
        try:
            lines = read_lines(handle if size is None else _first_bytes(handle, size))
            for row_index, (line_no, raw) in enumerate(lines):
                if row_index == 0:
                    _check_first_line(path, raw, line_no)
                yield _row(path, source_index, row_index, line_no, raw, on_bad_line, "line")
        except (OSError, EOFError) as exc:  # corrupt or cut gzip/zstd stream
            raise compressed_error(path, exc) from None


def _row(path: Path, source_index: int, row_index: int, line_no: int, raw: bytes, on_bad_line: str,
         what: str) -> Row:
    """The row of a JSONL line or an array element (`what`), or InputError for a bad one with --on-bad-line error."""
    data, error, bad_text = _parse_line(raw) if raw else (None, "is empty (a comma with no value)", None)
    if error is not None:
        error = f"{what} {error.removeprefix('line ')}"
        if on_bad_line == "error":
            raise InputError(error, where=f"{path}:{line_no}",
                             hint=f"fix the {what}, or pass --on-bad-line skip to record it in errors.parquet and go on")
    return Row(str(path), source_index, row_index, line_no, data, error, bad_text)


def is_json_array(path: Path) -> bool:
    """A `.json` file (compressed or not) whose JSON starts with `[`: its elements are the rows."""
    if not _name(path).endswith(".json"):
        return False
    with open_input(path) as handle:
        try:
            return starts_array(handle)
        except (OSError, EOFError) as exc:
            raise compressed_error(path, exc) from None


def _read_array(path: Path, source_index: int, on_bad_line: str) -> Iterator[Row]:
    with open_input(path) as handle:
        try:
            for row_index, (line_no, raw) in enumerate(array_elements(handle)):
                yield _row(path, source_index, row_index, line_no, raw, on_bad_line, "array element")
        except ArrayError as exc:
            raise InputError(str(exc), where=f"{path}:{exc.line}", hint=ARRAY_HINT) from None
        except (OSError, EOFError) as exc:
            raise compressed_error(path, exc) from None


def _check_first_line(path: Path, raw: bytes, line_no: int) -> None:
    """A file that is not JSONL says so at its first line: a JSON array (named .jsonl), or in a .json file,
    JSON that is no array and not one object a line (a pretty-printed object, a number)."""
    if raw.lstrip(b" \t").startswith(b"["):
        raise InputError("the file holds a JSON array ('[' at its start), not JSONL (one object a line)",
                         where=f"{path}:{line_no}", hint="name it .json to read the array's objects as rows")
    if not _name(path).endswith(".json") or _parse_line(raw)[0] is not None:
        return
    first = raw.strip()
    if first.startswith(b"{"):
        what = "a JSON object spread over several lines, not one object a line"
    else:
        try:
            what = f"JSON {type(json.loads(first)).__name__}, not an object or an array of objects"
        except ValueError:
            what = "not JSON"
    raise InputError(f"the file's first line is {what}", where=f"{path}:{line_no}", hint=ARRAY_HINT)


def _name(path: Path) -> str:
    """The file's name in lower case, without a compression suffix."""
    name = path.name.lower()
    for suffix in COMPRESSED_SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def _first_bytes(lines: Iterable[bytes], size: int) -> Iterator[bytes]:
    """The lines in the first `size` bytes (a boundary between lines, or the end of a final row)."""
    for raw in lines:
        if size <= 0:
            return
        yield raw[:size]
        size -= len(raw)


def read_lines(lines: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line that is not blank, with a UTF-8 byte-order mark at the start of
    the first line dropped: how qbatch splits a JSONL file (the service's upload check too)."""
    for line_no, raw in enumerate(lines, start=1):
        if line_no == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        if raw and not raw.isspace():  # (not strip(): a copy of each line, which may be hundreds of MB)
            yield line_no, raw


@dataclass(frozen=True, slots=True)
class ParsedLine:
    """A JSONL line as the run reads it."""

    data: dict[str, Any] | None  # None: the line is not a JSON object
    error: str | None  # why `data` is None (the run stops, or with --on-bad-line skip records a bad_line row)
    bad_text: str | None  # `data` holds text that is not Unicode, and where: the row fails alone (bad_text)


def parse_line(raw: bytes) -> ParsedLine:
    """One line of `read_lines`, parsed as the run parses it."""
    return ParsedLine(*_parse_line(raw))


def _parse_line(raw: bytes) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """(data, error, bad_text) as ParsedLine holds them; a tuple, since every line of every run takes this path."""
    if fast_loads is not None:
        try:
            data = fast_loads(raw)
        except FastJSONError:
            pass  # json says why, and accepts what orjson does not (NaN, Infinity, 1e400, lone surrogates)
        else:  # orjson takes UTF-8 and no lone surrogate: this data is text
            if isinstance(data, dict) and not _has_huge_number(data):
                return data, None, None
    bad_byte = None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:  # the line may still be JSON: its row then fails alone, keeping its id
        bad_byte, text = exc.start, raw.decode("utf-8", "surrogateescape")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if bad_byte is not None:
            return None, f"line is not valid UTF-8 (byte offset {bad_byte})", None
        # json's messages may end in "at" ("Unterminated string starting at"): one "at" before the column
        place = f"column {exc.colno}" if exc.lineno == 1 else f"its line {exc.lineno}, column {exc.colno}"  # an element
        return None, f"line is not valid JSON: {exc.msg.removesuffix(' at')} at {place}", None
    if not isinstance(data, dict):
        return None, f"line is JSON {type(data).__name__}, expected an object", None
    if bad_byte is not None:
        return data, None, not_utf8(data, bad_byte)
    return data, None, lone_surrogate(data) if SURROGATE_ESCAPE.search(raw) else None


def _has_huge_number(value: dict[str, Any] | list[Any]) -> bool:
    items: Iterable[Any] = value.values() if type(value) is dict else value
    for item in items:
        kind = type(item)
        if kind is float:
            if abs(item) >= HUGE_FLOAT:
                return True
        elif (kind is dict or kind is list) and _has_huge_number(item):
            return True
    return False


def _open_parquet(path: Path) -> pq.ParquetFile:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"not a readable Parquet file: {exc}", where=str(path)) from None


def parquet_schema(path: Path) -> pa.Schema:
    """The Arrow schema of a Parquet input (the types its columns keep in the results)."""
    return _open_parquet(path).schema_arrow


def _read_parquet(path: Path, source_index: int) -> Iterator[Row]:
    reader = _open_parquet(path)
    row_index = 0
    for batch in reader.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        try:
            rows, bad = batch.to_pylist(), dict[int, str]()
        except UnicodeDecodeError:  # text that is not UTF-8 (Arrow checks none when it reads): those rows fail
            rows, bad = _rows_with_bad_text(batch)
        for index, data in enumerate(rows):
            yield Row(str(path), source_index, row_index, None, data, None, bad.get(index) if bad else None)
            row_index += 1


def _rows_with_bad_text(batch: pa.RecordBatch) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """A batch's rows, with None for each value that is not UTF-8, and why each such row fails (by index)."""
    columns: dict[str, list[Any]] = {}
    bad: dict[int, str] = {}
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        try:
            columns[name] = column.to_pylist()
            continue
        except UnicodeDecodeError:
            pass
        values: list[Any] = []
        for index in range(len(column)):
            try:
                values.append(column[index].as_py())
            except UnicodeDecodeError:
                values.append(None)
                bad.setdefault(index, column_not_utf8(name))
        columns[name] = values
    names = list(columns)
    return [dict(zip(names, row, strict=True)) for row in zip(*columns.values(), strict=True)], bad
