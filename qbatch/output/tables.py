"""Parquet tables of results and failed rows: one chunk's rows as Arrow tables, and their schemas.

Result columns: id, source, source_index (dropped at assembly), row_index, the carried input
columns (types decided for the whole input: columns.py; one named like a result column is
`input_<name>`), prompt (optional), adapter (jobs with LoRA adapters), then the generation's text,
reasoning, finish_reason, flag (flags.py) and token counts.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from qbatch.output.columns import json_text
from qbatch.output.flags import row_flag
from qbatch.output.reasoning import split_reasoning
from qbatch.output.samples import COLUMN_TYPES, per_sample, sample_columns
from qbatch.records import THINK_CLOSE, Completion, Failure

ERROR_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("row_index", pa.int64()),
        ("line", pa.int64()),
        ("error", pa.string()),
        ("message", pa.string()),
    ]
)

# Result columns in order; carried input columns go between row_index and text.
RESULT_HEAD = [("id", pa.string()), ("source_index", pa.int32()), ("row_index", pa.int64())]
RESULT_TAIL = [
    ("text", pa.string()),
    ("reasoning", pa.string()),
    ("finish_reason", pa.string()),
    ("flag", pa.string()),  # null: a usable answer; else what is wrong with it (flags.py)
    ("prompt_tokens", pa.int32()),
    ("completion_tokens", pa.int32()),
    ("cached_tokens", pa.int32()),
]


def failures_table(failures: list[Failure]) -> pa.Table:
    columns = {name: [getattr(f, name) for f in failures] for name in ERROR_SCHEMA.names}
    return pa.Table.from_pydict(columns, schema=ERROR_SCHEMA)


def results_table(completions: list[Completion], sources: list[str], *, include_prompt: bool,
                  column_types: dict[str, pa.DataType | None] | None = None) -> pa.Table:
    """One chunk's results as an Arrow table.

    `column_types` (columns.ColumnScan's decision for the whole input) gives every part the
    same carried columns, in the same order and types (None: JSON text); without it, the
    types are inferred from this chunk alone.
    """
    completions, sample_indexes = per_sample(completions)  # n > 1: one result row a sample
    requests = [c.request for c in completions]
    columns: dict[str, Any] = {
        "id": [r.id for r in requests],
        "source": [sources[r.source_index] for r in requests],
        "source_index": [r.source_index for r in requests],
        "row_index": [r.row_index for r in requests],
    }
    columns.update(carried_columns(requests, column_types, own=own_columns(RESULT_COLUMNS, include_prompt)))
    if include_prompt:
        columns["prompt"] = [r.prompt for r in requests]
    if any(r.adapter is not None for r in requests):  # a job with adapters has the column (schema.py): null elsewhere
        columns[ADAPTER_COLUMN] = pa.array([r.adapter for r in requests], type=pa.string())
    if any(r.thinking is not None for r in requests):
        splits = [split_reasoning(c.text, c.request.thinking) for c in completions]
        columns["text"] = [text for _, text in splits]
        columns["reasoning"] = [reasoning for reasoning, _ in splits]
    else:  # no thinking model: the text as is (what split_reasoning returns for thinking=None)
        columns["text"] = [c.text for c in completions]
        columns["reasoning"] = [None] * len(completions)
    columns["finish_reason"] = [c.finish_reason for c in completions]
    columns["flag"] = None  # its place; set once the parse errors are known
    columns["prompt_tokens"] = [r.num_prompt_tokens for r in requests]
    columns["completion_tokens"] = [c.num_completion_tokens for c in completions]
    columns["cached_tokens"] = [c.num_cached_tokens for c in completions]
    if sample_indexes is not None:
        columns["sample_index"] = pa.array(sample_indexes, type=pa.int32())
    columns.update(sample_columns(completions, columns["text"]))
    columns["flag"] = flags_of(completions, columns["text"], columns.get("parse_error"))
    return pa.table({name: _array(name, values) for name, values in columns.items()})


def flags_of(completions: list[Completion], answers: list[str], parse_errors: pa.Array | None) -> pa.Array:
    """Each result row's flag (flags.py): what a user must not miss about its answer."""
    errors = [None] * len(completions) if parse_errors is None else parse_errors.to_pylist()
    return pa.array([row_flag(thinking=c.request.thinking, answer=answer, reasoning_closed=THINK_CLOSE in c.text,
                              finish_reason=c.finish_reason, parse_error=error)
                     for c, answer, error in zip(completions, answers, errors, strict=True)], type=pa.string())


def carried_columns(requests: list[Any], column_types: dict[str, pa.DataType | None] | None, *,
                    own: set[str]) -> dict[str, pa.Array]:
    """The requests' carried input columns as arrays, in the types decided for the whole input
    (None: inferred from these rows alone), by their results' names (`carried_name`)."""
    if column_types is None:
        key_orders = dict.fromkeys(tuple(r.extra) for r in requests)  # rows mostly share one: cheaper than per-row dicts
        names = list(dict.fromkeys(name for order in key_orders for name in order))
    else:
        names = list(column_types)
    carried: dict[str, pa.Array] = {}
    for name in names:
        if name == ID_COLUMN:
            continue
        values = [r.extra.get(name) for r in requests]
        carried[carried_name(name, own)] = (_array(name, values) if column_types is None
                                            else _typed_array(values, column_types[name]))
    return carried


ADAPTER_COLUMN = "adapter"  # the LoRA adapter's name, null for the base model's rows (jobs with --lora)
ID_COLUMN = "id"  # an input's `id` column is the results' id (as text): not carried again


def carried_name(name: str, own: set[str]) -> str:
    """A carried input column's name in the results: its own, or `input_<name>` where the results
    use the name for a column of their own (an input's `text`, or `prompt` with --include-prompt),
    so that neither hides the other."""
    while name in own:
        name = f"input_{name}"
    return name


def own_columns(columns: set[str], include_prompt: bool) -> set[str]:
    """The names a results table uses for its own columns: `prompt` only with --include-prompt."""
    return columns if include_prompt else columns - {"prompt"}


RESULT_COLUMNS = {"id", "source", "source_index", "row_index", "prompt", *(name for name, _ in RESULT_TAIL),
                  *COLUMN_TYPES}
_TYPES = dict([*RESULT_HEAD, *RESULT_TAIL, ("source", pa.string()), ("prompt", pa.string())])


def _array(name: str, values: list[Any]) -> pa.Array:
    if isinstance(values, pa.Array):
        return values
    if name in _TYPES:
        return pa.array(values, type=_TYPES[name])
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed types across rows: keep them as JSON text
        return _typed_array(values, None)


def _typed_array(values: list[Any], kind: pa.DataType | None) -> pa.Array:
    """A carried column's values with the type decided for the whole input; None: JSON text,
    every value (strings too) through json.dumps, so that every value parses as JSON."""
    return json_text(values) if kind is None else pa.array(values, type=kind)
