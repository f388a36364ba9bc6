"""Readers: JSONL (plain, .gz, .zst) and Parquet files, streamed as `Row`s.

Nothing is read whole: JSONL goes line by line, Parquet in record batches.
A line that cannot be parsed becomes a `Row` with an error (or stops the run
with `--on-bad-line error`), so every line is accounted for.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from qbatch.errors import InputError
from qbatch.spec import COMPRESSED_SUFFIXES
from qbatch.records import Row

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

try:  # parses a typical line several times faster than json (the input is parsed twice: pre-scan and run)
    from orjson import JSONDecodeError as FastJSONError, loads as fast_loads
except ImportError:  # json alone gives the same rows
    fast_loads = None

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
HUGE_FLOAT = float(2**63)  # orjson reads integers beyond 64 bits as floats; json keeps them exact
PARQUET_BATCH_ROWS = 4096


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Turn files, folders and globs into a sorted, de-duplicated list of files, as `stable_path`s."""
    if not inputs:
        raise InputError("no input files given", hint="pass files, folders or globs: `qbatch run prompts.jsonl -o out/`")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if any(ch in item for ch in "*?["):
            matches = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
            if not matches:
                raise InputError("no files match the pattern", where=item)
            files.extend(matches)
        elif path.is_dir():
            matches = sorted(p for p in path.rglob("*") if p.is_file() and detect_format(p, None, strict=False))
            if not matches:
                raise InputError("folder holds no .jsonl/.ndjson/.parquet files", where=item)
            files.extend(matches)
        elif path.exists():
            files.append(path)
        else:
            raise InputError("input file not found", where=item, hint="check the path; globs must be quoted")
    seen: set[Path] = set()
    return [stable_path(f) for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]


def stable_path(path: Path) -> Path:
    """The file's folder resolved, then its own name: the same for every working directory and
    spelling, so the `source` of a resumed run's rows is one value. The name is kept as given
    (not a link's target): positional row ids are built from it."""
    return path.parent.resolve() / path.name


def detect_format(path: Path, override: str | None, *, strict: bool = True) -> str | None:
    """'jsonl' or 'parquet' from `--format` or the file name."""
    if override:
        return override
    name = path.name.lower()
    for suffix in COMPRESSED_SUFFIXES:
        name = name.removesuffix(suffix)
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


def read_rows(files: list[Path], *, fmt: str | None = None, on_bad_line: str = "error") -> Iterator[Row]:
    """All rows of all files, in order."""
    for source_index, path in enumerate(files):
        kind = detect_format(path, fmt)
        if kind == "parquet":
            yield from _read_parquet(path, source_index)
        else:
            yield from _read_jsonl(path, source_index, on_bad_line)


def _open_text_bytes(path: Path) -> IO[bytes]:
    name = path.name.lower()
    try:
        raw = open(path, "rb")
    except IsADirectoryError:
        raise InputError("input is a folder, not a file", where=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot open input: {exc.strerror}", where=str(path)) from None
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)  # type: ignore[return-value]
    if name.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return raw


def _read_jsonl(path: Path, source_index: int, on_bad_line: str) -> Iterator[Row]:
    row_index = 0
    with _open_text_bytes(path) as handle:
        try:
            for line_no, raw in enumerate(handle, start=1):
                if not raw.strip():
                    continue
                data, error = _parse_line(raw)
                if error is not None and on_bad_line == "error":
                    raise InputError(
                        error,
                        where=f"{path}:{line_no}",
                        hint="fix the line, or pass --on-bad-line skip to record it in errors.parquet and go on",
                    )
                yield Row(str(path), source_index, row_index, line_no, data, error)
                row_index += 1
        except (OSError, EOFError) as exc:  # corrupt gzip/zstd stream
            raise InputError(f"cannot read compressed input: {exc}", where=str(path)) from None


def _parse_line(raw: bytes) -> tuple[dict | None, str | None]:
    if fast_loads is not None:
        try:
            data = fast_loads(raw)
        except FastJSONError:
            pass  # json says why, and accepts what orjson does not (NaN, Infinity, 1e400, lone surrogates)
        else:
            if isinstance(data, dict) and not _has_huge_number(data):
                return data, None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"line is not valid UTF-8 (byte offset {exc.start})"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"line is not valid JSON: {exc.msg} at column {exc.colno}"
    if not isinstance(data, dict):
        return None, f"line is JSON {type(data).__name__}, expected an object"
    return data, None


def _has_huge_number(value: dict | list) -> bool:
    for item in value.values() if type(value) is dict else value:
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
        for data in batch.to_pylist():
            yield Row(str(path), source_index, row_index, None, data)
            row_index += 1
