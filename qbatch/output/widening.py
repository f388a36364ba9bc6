"""The parts of a resumed run whose carried columns it widened (columns.keep_recorded: rows appended to
the input hold a float where an int column had ints), rewritten in the widened types.

The rule: every part of a folder holds each carried column in the type the manifest records, so that
assembly, `qbatch merge` and days of a job concatenate them as one. A widening run rewrites the parts
written before it, each atomically, before it records the new types or writes a part of its own; a run
killed half way leaves parts of both types under the old record, and its rerun widens the rest (a part
already widened is left as it is: JSON text is marked in its field's metadata, never encoded twice).
Nothing is lost or doubled: a part keeps its rows and its name; only a column's type changes.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from qbatch._fs import atomic_write
from qbatch.output.columns import JSON_MARK, JSON_TEXT, ColumnTypes, json_text, same_type
from qbatch.output.folder import RESULT_PREFIX, OutputDir
from qbatch.output.reading import PART_HINT, reading
from qbatch.output.tables import ID_COLUMN, carried_name


def widened(recorded: ColumnTypes, types: ColumnTypes) -> ColumnTypes:
    """The carried columns the earlier parts hold in another type than `types` (by input column name)."""
    return {name: types[name] for name, old in recorded.items()
            if name in types and not same_type(old, types[name])
            and not (old is not JSON_TEXT and pa.types.is_null(old))}


def widen_parts(out: OutputDir, recorded: ColumnTypes, types: ColumnTypes, *, own: set[str]) -> int:
    """Rewrite the result parts that hold a carried column in its `recorded` type where `types` widened it
    (`own`: the names the results use for columns of their own, schema.own_names); how many were."""
    columns = {carried_name(name, own): kind for name, kind in widened(recorded, types).items() if name != ID_COLUMN}
    rewritten = 0
    for path in out.whole_part_files(RESULT_PREFIX) if columns else []:
        with reading(path, PART_HINT):
            schema = pq.read_schema(path)
        todo = {name: kind for name, kind in columns.items()
                if name in schema.names and not _holds(schema.field(name), kind)}
        if todo:
            _rewrite(path, todo)
            rewritten += 1
    return rewritten


def _holds(field: pa.Field, kind: pa.DataType | None) -> bool:
    if kind is JSON_TEXT:
        return bool(field.metadata == JSON_MARK)
    return bool(field.type == kind)


def _rewrite(path: Path, columns: dict[str, pa.DataType | None]) -> None:
    with reading(path, PART_HINT):
        table = pq.read_table(path)
    for name, kind in columns.items():
        index = table.schema.get_field_index(name)
        values = table.column(index).to_pylist()
        if kind is JSON_TEXT:
            field, array = pa.field(name, pa.string(), metadata=JSON_MARK), json_text(values)
        else:
            field, array = pa.field(name, kind), pa.array(values, type=kind)
        table = table.set_column(index, field, array)
    atomic_write(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))
