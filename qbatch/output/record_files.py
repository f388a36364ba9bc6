"""Typed records (dataclasses) and their JSON files (manifest.json, stats.json), by one rule read from the
records' fields, so that a new field is declared once: the shape a file is checked against (shape_of, for
reading.read_checked), how a record is loaded from its file (load_record) and saved into it (save_record).

A field's metadata may say what its type cannot: SHAPE (text that must decode, the fields a reader uses of
a dict), or NOT_IN_FILE (the record holds it, its file does not).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import UnionType
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from qbatch.output.reading import Needed, Shape, Values

R = TypeVar("R")
SHAPE = "shape"  # a field's metadata key: its shape where its type cannot say it
NOT_IN_FILE = {"in_file": False}  # a field's metadata: the record holds it, its file does not


def file_fields(record: Any) -> list[dataclasses.Field[Any]]:
    """A record's fields that its file holds (all but those marked NOT_IN_FILE), in order."""
    return [f for f in dataclasses.fields(record) if f.metadata.get("in_file", True)]


def shape_of(record: type) -> dict[str, Shape]:
    """The shape of a typed record's file (a dataclass's), from its fields: the type of each (a record within
    is its own shape, X | None may be null, list[X] and tuple[X, ...] lists, dict[str, X] Values(X), Any
    anything), or the SHAPE in its metadata; a field without a default must be there (Needed)."""
    hints = get_type_hints(record)
    shape: dict[str, Shape] = {}
    for f in file_fields(record):
        inner = f.metadata[SHAPE] if SHAPE in f.metadata else _type_shape(hints[f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        shape[f.name] = Needed(inner) if required else inner
    return shape


def _type_shape(hint: Any) -> Shape:
    if hint is Any:
        return object
    if dataclasses.is_dataclass(hint):
        return shape_of(hint)  # type: ignore[arg-type]  # a class here: the instance case is no type hint
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        return tuple(None if a is type(None) else _type_shape(a) for a in args)
    if origin in (list, tuple):
        return [_type_shape(args[0])]
    if origin is dict:
        return dict if args[1] is Any else Values(_type_shape(args[1]))
    return origin or hint


def load_record(record: type[R], data: Mapping[str, Any]) -> R:
    """A typed record from its file's object (checked by its shape): each field that is there (a record
    within, or a list or tuple of them, loaded the same way), the others their defaults; keys that are
    no field (a newer qbatch's) left out."""
    hints = get_type_hints(record)
    return record(**{f.name: _loaded(hints[f.name], data[f.name]) for f in file_fields(record) if f.name in data})


def _loaded(hint: Any, value: Any) -> Any:
    if get_origin(hint) in (Union, UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    if value is None:
        return None
    if dataclasses.is_dataclass(hint):
        return load_record(hint, value)  # type: ignore[arg-type]  # a class here: the instance case is no type hint
    if get_origin(hint) in (list, tuple) and dataclasses.is_dataclass(get_args(hint)[0]):
        return get_origin(hint)(load_record(get_args(hint)[0], item) for item in value)
    return value


def save_record(record: Any, *, nulls: bool = False) -> dict[str, Any]:
    """A typed record as its file holds it: its fields in order (a record within saved the same way, a
    tuple as a list); a field that is None is left out, unless `nulls`."""
    saved = {}
    for f in file_fields(record):
        value = getattr(record, f.name)
        if dataclasses.is_dataclass(value):
            value = save_record(value)
        elif isinstance(value, (list, tuple)) and value and dataclasses.is_dataclass(value[0]):
            value = [save_record(item) for item in value]
        if value is not None or nulls:
            saved[f.name] = list(value) if isinstance(value, tuple) else value
    return saved
