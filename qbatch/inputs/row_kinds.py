"""A row's kind (`--shape`: its shape) and its key: which way of writing a request it uses (a prompt, chat messages, an
OpenAI Batch API line, a --template over its columns) and which column holds its id.

A null counts as absent: a DataFrame (or a Parquet file written from one) of mixed rows holds a
null in every column a row lacks. An OpenAI batch line is keyed by its `custom_id` whatever other
keys it carries, as OpenAI reads it: its answer must come back under that key.
"""

from __future__ import annotations

import math
import re
import string
from pathlib import Path
from typing import Any

from qbatch.errors import RowError, SpecError
from qbatch.inputs.text import escaped, is_text
from qbatch.inputs.validate import EMBEDDINGS_URL, OPENAI_URLS, keys
from qbatch.records import Row
from qbatch.spec import InputSpec

BATCH_URLS = (*OPENAI_URLS, EMBEDDINGS_URL)
ID_HINT = "give every row an id, or drop the column to number rows by position, or pass --id-column"
STAND_IN_HINT = ("give every row its own id (an `id` column, or --id-column NAME), or rename one of two inputs "
                 "of the same name")


def is_openai(data: dict[str, Any], spec: InputSpec) -> bool:
    """An OpenAI Batch API line: by --shape openai, or (auto) by its keys, with or without custom_id."""
    if spec.template or spec.shape not in ("auto", "openai"):
        return False
    if spec.shape == "openai":
        return True
    if data.get("custom_id") is not None:
        return data.get("body") is not None or data.get("url") is not None
    return isinstance(data.get("body"), dict) and data.get("url") in BATCH_URLS  # lost its id


def row_shape(data: dict[str, Any], spec: InputSpec) -> str:
    """template, openai, chat or prompt; RowError("missing_prompt") for a row with none of their columns."""
    if spec.template:
        return "template"
    if spec.shape != "auto":
        return spec.shape
    if is_openai(data, spec):
        return "openai"
    if data.get(spec.messages_column) is not None and data.get(spec.prompt_column) is None:
        return "chat"
    if spec.prompt_column in data:
        return "prompt"
    if spec.messages_column in data:
        return "chat"
    raise RowError(
        "missing_prompt",
        f"row has no '{spec.prompt_column}' or '{spec.messages_column}' column; keys: {keys(data)}. "
        "Use --prompt-column NAME or --template '...{column}...'",
    )


def own_id(data: dict[str, Any], spec: InputSpec) -> str | None:
    """The id the row gives itself, or None when it has none: a batch line's custom_id, else the
    --id-column (which must be there), else `id`, else `custom_id`. RowError("missing_id") when the
    row has the column but no usable value in it: its position in place of the id could equal
    another row's real id."""
    if is_openai(data, spec):
        column, hint = "custom_id", "every request needs its own, to match its result"
        if column not in data:
            return None
    elif spec.id_column:
        column, hint = spec.id_column, "set by --id-column"
    else:
        found = next((name for name in ("id", "custom_id") if name in data), None)
        if found is None:
            return None
        column, hint = found, ID_HINT
    return id_text(data.get(column), column, data, hint=hint)


def id_text(value: Any, column: str, data: dict[str, Any], *, hint: str) -> str:
    """An id value as text: strings as they are (when they are text: output/tables.py writes them),
    integers and integral floats (Parquet ints with nulls arrive as floats) as integer text ("10"),
    other finite floats as Python's shortest repr."""
    if isinstance(value, str) and value != "" and is_text(value):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() else repr(value)
    if value is None:
        problem = "is missing" if column not in data else "is null"
    elif value == "":
        problem = "is empty"
    elif isinstance(value, str):
        problem = f"is not text: {escaped(value)!r}"
    else:
        problem = f"must be a string or a number, got {value!r}"
    raise RowError("missing_id", f"'{column}' {problem} ({hint}); keys: {keys(data)}")


def positional_id(row: Row, positional_prefix: bool) -> str:
    """The id of a row without an id column: its position (prefixed by its file's name with several files)."""
    return f"{Path(row.source).name}:{row.row_index}" if positional_prefix else str(row.row_index)


def fallback_id(row: Row) -> str:
    """An id for a row whose own id is missing or unreadable: file name and position."""
    return f"{Path(row.source).name}#{row.row_index}"


def has_own_id(row: Row, spec: InputSpec) -> bool:
    """Whether the row's id is its own: else it is a stand-in (positional_id, fallback_id)."""
    if row.data is None:
        return False
    try:
        return own_id(row.data, spec) is not None
    except RowError:
        return False


class StandIns:
    """The pre-scan's record of the stand-in ids it met (rows without a usable id, named by position).

    A stand-in may equal another row's real id ("0", "in.jsonl#3"), or another stand-in (two inputs of
    one name in two folders): two rows, not one row twice, which --dedupe would drop one of.
    """

    def __init__(self, spec: InputSpec):
        self.spec = spec
        self.ids: set[str] = set()

    def add(self, row: Row, rid: str) -> None:
        if not has_own_id(row, self.spec):
            self.ids.add(rid)

    def clashes(self, counts: dict[str, int]) -> list[str]:
        """The stand-ins that name more than one row (`counts`: the rows of each id)."""
        return sorted(rid for rid in self.ids if counts.get(rid, 0) > 1)


class NamedColumns:
    """The pre-scan's check that the columns the job names exist in the input.

    A prompt column, messages column, --id-column or --template column that no row has would
    fail every row, so the run stops before the engine starts. The prompt and messages columns
    are alternatives (a row has one or the other); OpenAI batch lines use none of them.
    """

    def __init__(self, spec: InputSpec):
        self.spec = spec
        self.missing = _named(spec)  # groups of (column, flag): found once a row has one of the group
        self.columns: set[str] = set()
        self.plain_rows = False  # rows that are no batch lines: those the named columns are for
        self.batch_lines = False

    def add(self, row: Row) -> None:
        if not self.missing or row.data is None or row.bad_text is not None:
            return
        data = row.data
        if is_openai(data, self.spec):
            self.batch_lines = True
            return
        self.plain_rows = True
        self.columns.update(data)
        self.missing = [group for group in self.missing if all(data.get(column) is None for column, _ in group)]

    def check(self) -> None:
        """SpecError (exit 2) naming the first column no row has, with the input's columns."""
        if not self.missing:
            return
        if not self.plain_rows:
            if self.batch_lines and self.spec.id_column:
                raise SpecError("--id-column does not apply to OpenAI batch lines: each is keyed by its custom_id",
                                where="--id-column", hint="leave --id-column out")
            return
        group = self.missing[0]
        named = " or ".join(f"'{column}' ({flag})" for column, flag in group)
        columns = ", ".join(sorted(escaped(str(name)) for name in self.columns)) or "(none)"
        flags = " or ".join(dict.fromkeys(flag for _, flag in group))
        raise SpecError(f"no row of the input has the column {named}; its columns: {columns}",
                        where=group[0][1], hint=f"name one of its columns with {flags}")


def _named(spec: InputSpec) -> list[list[tuple[str, str]]]:
    groups = []
    if spec.template:
        groups += [[(name, "--template")] for name in template_columns(spec.template)]
    elif spec.shape != "openai":
        prompt, messages = (spec.prompt_column, "--prompt-column"), (spec.messages_column, "--messages-column")
        groups.append({"auto": [prompt, messages], "prompt": [prompt], "chat": [messages]}[spec.shape])
    if spec.id_column:
        groups.append([(spec.id_column, "--id-column")])
    return groups


def template_columns(template: str) -> list[str]:
    """The columns a --template reads ({title}, {meta.author}, {tags[0]}); none when it cannot be parsed
    (each row then fails with the reason)."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    except ValueError:
        return []
    names = [re.split(r"[.\[]", name, maxsplit=1)[0] for name in fields]
    return list(dict.fromkeys(name for name in names if name and not name.isdigit()))
