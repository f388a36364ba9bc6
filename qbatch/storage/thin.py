"""Thin copies: a Parquet object of an output folder copied as the few columns a reader needs (a part's ids,
for a resume's done ids or `qbatch status`' counts), read from the store by byte ranges (the footer, then
those columns' pages), instead of the whole object.

A thin copy is marked (THIN_MARK in its schema's metadata) so that it is never taken for the object: the
stage that made it uploads no file that still carries the mark (stage.py), and a reader that needs every
column makes it whole first (StagedFolder.fill). An object under THIN_MIN_BYTES is copied whole: a thin
read costs about a Parquet footer read (64 KiB) and a second download when it is filled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qbatch._fs import atomic_write
from qbatch.log import log
from qbatch.storage.store import ObjectInfo, Store

THIN_MARK = b"qbatch.thin_copy"
THIN_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Thin:
    """Which objects of a folder a stage copies thin (`names`: by their name below the folder) and the
    columns it keeps of them (those the object has)."""

    names: Callable[[str], bool]
    columns: tuple[str, ...]


def copy_thin(store: Store, found: ObjectInfo, local: Path, columns: tuple[str, ...]) -> bool:
    """`found`'s `columns` as the marked Parquet file `local`; False (nothing written) when that would not
    pay (a small object) or cannot be done (not Parquet that pyarrow reads: the whole copy's reader says why)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if found.size < THIN_MIN_BYTES:
        return False
    try:
        with pq.ParquetFile(store.ranges(found)) as source:
            names = source.schema_arrow.names
            table = source.read(columns=[c for c in columns if c in names])
    except (pa.ArrowException, OSError, ValueError) as exc:
        log.debug(f"{found.url}: copied whole, not thin ({exc})")
        return False
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), THIN_MARK: b"1"})
    local.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(local, lambda tmp: pq.write_table(table, tmp))
    return True


def is_thin(path: Path) -> bool:
    """Whether the file `path` is (still) a thin copy: a rewrite that kept its metadata keeps the mark."""
    import pyarrow.parquet as pq

    try:
        return THIN_MARK in (pq.read_schema(path).metadata or {})
    except Exception:  # not Parquet, or no longer there: not a thin copy
        return False
