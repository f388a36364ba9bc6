"""Inputs that can be read only once (standard input, pipes, FIFOs) are copied to files first.

A run reads its inputs more than once (the hash of the fingerprint, the id pre-scan, the
run itself) and Parquet needs to seek, so such an input is copied ("spooled") into
OUT_DIR/inputs/ under a temporary name, then renamed; the run reads the copy. The copy's
name depends only on the input's position and kind, so a rerun that pipes the same rows
(or the same rows plus appended ones) finds the same input path and resumes, and other
rows are refused as any changed input is. A dry run spools to a temporary folder.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import IO

from qbatch._fs import atomic_write
from qbatch.errors import InputError
from qbatch.inputs.readers import BOM, detect_format
from qbatch.spec import JobSpec

STDIN = "-"
SPOOL_FOLDER = "inputs"
STDIN_NAMES = (STDIN, "/dev/stdin", "/proc/self/fd/0")
FD_PREFIXES = ("/dev/fd/", "/proc/self/fd/")  # what `<(...)` gives: a pipe whose number varies
MAGIC_SUFFIXES = ((b"\x1f\x8b", ".gz"), (b"\x28\xb5\x2f\xfd", ".zst"))
PARQUET_MAGIC = b"PAR1"


def is_stream(item: str) -> bool:
    """Standard input, a file descriptor path, or a FIFO, socket or device: no file to read twice."""
    if item in STDIN_NAMES or item.startswith(FD_PREFIXES):
        return True
    try:
        mode = os.stat(item).st_mode
    except OSError:  # not a path (a glob), or missing: expand_inputs says so
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISSOCK(mode)


def has_streams(inputs: list[str]) -> bool:
    return any(is_stream(item) for item in inputs)


def spool_streams(spec: JobSpec, folder: Path) -> JobSpec:
    """A spec whose stream inputs are replaced by their copies under `folder`/inputs/."""
    streams = [item for item in spec.input.inputs if is_stream(item)]
    if sum(item in STDIN_NAMES for item in streams) > 1:
        raise InputError("standard input is given more than once; it can be read only once",
                         hint="pass `-` once, e.g. `cat a.jsonl b.jsonl | qbatch run - -o out/`")
    if not streams:
        return spec
    target = folder / SPOOL_FOLDER
    target.mkdir(parents=True, exist_ok=True)
    inputs = [str(_spool(item, position, target, spec.input.format)) if is_stream(item) else item
              for position, item in enumerate(spec.input.inputs)]
    return dataclasses.replace(spec, input=dataclasses.replace(spec.input, inputs=inputs))


@contextmanager
def spooled_for_dry_run(spec: JobSpec) -> Iterator[JobSpec]:
    """The spec with its streams spooled to a temporary folder, removed afterwards."""
    if not has_streams(spec.input.inputs):
        yield spec
        return
    with tempfile.TemporaryDirectory(prefix="qbatch-spool-") as folder:
        yield spool_streams(spec, Path(folder))


def _spool(item: str, position: int, folder: Path, fmt: str | None) -> Path:
    with _open_stream(item) as source:
        head = source.read(4)
        path = folder / _copy_name(item, position, fmt, head)

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as copy:
                copy.write(head)
                shutil.copyfileobj(source, copy, 1 << 20)

        atomic_write(path, write)
    return path


def _open_stream(item: str) -> AbstractContextManager[IO[bytes]]:
    if item == STDIN:
        handle = sys.stdin.buffer
        if handle.isatty():
            raise InputError("standard input is a terminal, not a stream of rows", where=STDIN,
                             hint="pipe rows in: `cat prompts.jsonl | qbatch run - -o out/`")
        return nullcontext(handle)  # standard input stays open
    try:
        handle = open(item, "rb")
    except OSError as exc:
        raise InputError(f"cannot open input: {exc.strerror}", where=item) from None
    if handle.isatty():
        handle.close()
        raise InputError("input is a terminal, not a stream of rows", where=item,
                         hint="pipe rows in: `cat prompts.jsonl | qbatch run - -o out/`")
    return handle


def _copy_name(item: str, position: int, fmt: str | None, head: bytes) -> str:
    """`<position>-<name>.<format>[.gz|.zst]`: stdin and `<(...)` have no name of their own that lasts.

    The format is --format, else the FIFO's name, else what the first bytes say (Parquet
    starts with PAR1), else JSONL; compressed JSONL keeps its suffix so that it is read as such, and
    JSON rows that start with `[` are an array, named .json.
    """
    if item in STDIN_NAMES or item.startswith(FD_PREFIXES):
        stem, named = ("stdin" if item in STDIN_NAMES else "stream"), None
    else:
        name = Path(item).name
        stem, named = name.split(".", 1)[0], detect_format(Path(name), None, strict=False)
    kind = fmt or named or ("parquet" if head.startswith(PARQUET_MAGIC) else "jsonl")
    compression = next((s for magic, s in MAGIC_SUFFIXES if head.startswith(magic)), "") if kind == "jsonl" else ""
    if kind == "jsonl" and head.removeprefix(BOM).lstrip(b" \t\r\n").startswith(b"["):
        kind = "json"  # a JSON array of rows, read as such from a .json file (readers.is_json_array)
    return f"{position}-{stem}.{kind}{compression}"
