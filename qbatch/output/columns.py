"""Carried columns' output types: one decision per column for the whole input.

The rule: a carried column keeps its Arrow type when the whole input agrees on
one (a Parquet column: its schema's type; a JSONL column: the type Arrow infers
from all its values, where nulls and int/float mixes widen; a row that fails on
its own input, inputs/prepare.py `carried`, counts only for a column that no
passing row gives a value); otherwise every
value of the column is written as JSON text (`json.dumps`). The decision is made
in the pre-scan, before any part is written, so a column's type and values never
depend on how rows were chunked, ordered, sharded or resumed; the manifest
records it, and a resumed run keeps it, widened when rows appended to the input need it.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pyarrow as pa

JSON_TEXT = None  # the decision "write this column as JSON text"
SCAN_BATCH_ROWS = 4096  # values inferred per call: Arrow's inference is fast per batch, slow per value
JSON_MARK = {b"qbatch": b"json"}

ColumnTypes = dict[str, pa.DataType | None]  # column -> its Arrow type, or JSON_TEXT


class ColumnScan:
    """Decides each carried column's type from every row of the input, row by row.

    The rows that pass decide; a row that fails on its own input (a number for a prompt) goes to the
    errors, so its values count only for a column no passing row gave a value: the columns of a job
    whose rows all fail still get their types, and its results concatenate with those of other days.
    """

    def __init__(self, parquet_schemas: dict[int, pa.Schema]):
        self._order: dict[str, None] = {}  # the columns, in the order they first appear
        self._passing = _Votes()
        self._failing = _Votes()
        self._schemas = parquet_schemas  # source_index -> schema, for Parquet inputs
        self._typed: set[tuple[int, str]] = set()  # (Parquet source, column) already merged

    def add(self, extra: dict[str, Any], source_index: int, *, fails: bool = False) -> None:
        """One row's carried columns (from the input file numbered `source_index`); `fails`: the row
        fails on its own input."""
        schema = self._schemas.get(source_index)
        votes = self._failing if fails else self._passing
        for name, value in extra.items():
            self._order.setdefault(name)
            if schema is None:
                votes.add(name, value)
            elif (source_index, name) not in self._typed:  # a Parquet file's schema: its type, whatever its rows
                self._typed.add((source_index, name))
                index = schema.get_field_index(name)
                self._passing.merge(name, schema.field(index).type if index >= 0 else pa.null())
        votes.row_done()

    def finish(self) -> ColumnTypes:
        passing, failing = self._passing.finish(), self._failing.finish()
        types: ColumnTypes = {}
        for name in self._order:
            kind = passing.get(name, pa.null())
            types[name] = failing.get(name, pa.null()) if kind is not JSON_TEXT and pa.types.is_null(kind) else kind
        return types


class _Votes:
    """The types a set of rows' values give each column (JSON_TEXT where they do not agree)."""

    def __init__(self) -> None:
        self.types: ColumnTypes = {}
        self._pending: dict[str, list[Any]] = {}
        self._num_pending = 0

    def add(self, name: str, value: Any) -> None:
        kind = self.types.setdefault(name, pa.null())
        if kind is not JSON_TEXT:
            self._pending.setdefault(name, []).append(value)

    def row_done(self) -> None:
        self._num_pending += 1
        if self._num_pending >= SCAN_BATCH_ROWS:
            self._flush()

    def finish(self) -> ColumnTypes:
        self._flush()
        return self.types

    def _flush(self) -> None:
        for name, values in self._pending.items():
            try:
                inferred = pa.array(values).type
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):  # mixed kinds, or ints beyond 64 bits
                self.types[name] = JSON_TEXT
            else:
                self.merge(name, inferred)
        self._pending.clear()
        self._num_pending = 0

    def merge(self, name: str, new: pa.DataType) -> None:
        old = self.types.setdefault(name, pa.null())
        if old is JSON_TEXT:
            return
        merged = unify(old, new)
        self.types[name] = merged if merged is not None and writable(merged) else JSON_TEXT


def unify(old: pa.DataType, new: pa.DataType) -> pa.DataType | None:
    """The type both fit in (nulls and int/float widen, struct fields merge), or None."""
    if old == new:
        return old
    try:
        schema = pa.unify_schemas([pa.schema([("c", old)]), pa.schema([("c", new)])], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    return schema.field("c").type


def writable(kind: pa.DataType) -> bool:
    """Whether Parquet can store the type: a struct needs at least one field (`{}` values infer none)."""
    if pa.types.is_struct(kind):
        return kind.num_fields > 0 and all(writable(kind.field(i).type) for i in range(kind.num_fields))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return writable(kind.value_type)
    return True


def keep_recorded(recorded: ColumnTypes, scanned: ColumnTypes) -> ColumnTypes:
    """The types of a resumed run: those its earlier parts were written with, widened to hold the rows
    read now (rows appended to the input: an int column that now holds a float becomes double; kinds
    that do not mix, JSON text), plus new columns. The scan reads every row, old ones too, so the
    widened type is the one a first run on today's input decides; the parts written before are
    rewritten in it (widening.py) before any new one is written."""
    types = dict(recorded)
    for name, new in scanned.items():
        types[name] = widen(types.get(name, pa.null()), new)
    return types


def widen(old: pa.DataType | None, new: pa.DataType | None) -> pa.DataType | None:
    """The type that holds the values of both (JSON_TEXT: one of them, or no Arrow type, is JSON text)."""
    if old is JSON_TEXT or new is JSON_TEXT:
        return JSON_TEXT
    merged = unify(old, new)
    return merged if merged is not None and writable(merged) else JSON_TEXT


def same_type(old: pa.DataType | None, new: pa.DataType | None) -> bool:
    return old is new if JSON_TEXT in (old, new) else old == new


def json_text(values: list[Any]) -> pa.Array:
    """A carried column's values as JSON text: every value (strings too) through json.dumps, so that every
    value parses as JSON."""
    return pa.array([None if v is None else json.dumps(v, default=str, ensure_ascii=False) for v in values],
                    type=pa.string())


def describe(kind: pa.DataType | None) -> str:
    return "json" if kind is JSON_TEXT else str(kind)


def to_manifest(types: ColumnTypes) -> tuple[dict[str, str], str]:
    """The manifest's record of the decision (its `columns` and `column_schema`): readable names, and the exact types."""
    fields = [pa.field(name, pa.string(), metadata=JSON_MARK) if kind is JSON_TEXT else pa.field(name, kind)
              for name, kind in types.items()]
    return {name: describe(kind) for name, kind in types.items()}, encode_schema(pa.schema(fields))


def from_manifest(column_schema: str | None) -> ColumnTypes | None:
    """The decision an earlier run recorded (its manifest's `column_schema`), or None (no earlier run, or
    one from before the record)."""
    if not column_schema:
        return None
    schema = decode_schema(column_schema)
    return {field.name: JSON_TEXT if field.metadata == JSON_MARK else field.type for field in schema}


def encode_schema(schema: pa.Schema) -> str:
    """An Arrow schema as manifest text (exact types: structs, lists, metadata)."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def decode_schema(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))
