"""results.parquet's columns and types, decided by the job before any row is generated.

The rule: the columns depend on the job, never on which of its rows succeeded. The job's task
(generate or embed), its settings (`prompt` with --include-prompt; `adapter` with --lora; `sample_index` with n > 1;
`parsed` and `parse_error` with a constraint; `logprobs` with logprobs, and `choice_logprobs` with
a choice constraint too; the embedding's size and dtype) and its carried columns' types
(columns.py) decide them. A run whose rows all failed thus writes an empty file with the same
columns and types as any other run of the job, and days of one job concatenate. A row's own n,
constraint or logprobs in a job without them adds that column where such a row has a result.

The opening records the schema in the manifest; assembly (and `qbatch merge`) writes the results
in it: its columns in its order (null where no part holds one), then the columns rows added.
"""

from __future__ import annotations

from typing import Any

import polars as pl
import pyarrow as pa

from qbatch.output.columns import JSON_TEXT, ColumnTypes, decode_schema, encode_schema
from qbatch.output.embeddings import ARROW_TYPES, EMBEDDING_COLUMNS
from qbatch.output.samples import COLUMN_TYPES
from qbatch.output.tables import ADAPTER_COLUMN, ID_COLUMN, RESULT_COLUMNS, RESULT_TAIL, carried_name, own_columns
from qbatch.spec import JobSpec

MANIFEST_KEY = "result_schema"
HEAD = [("id", pa.string()), ("source", pa.string()), ("row_index", pa.int64())]


def result_schema(spec: JobSpec, column_types: ColumnTypes, vector_size: int | None) -> pa.Schema:
    """The columns and types of a job's results.parquet (`vector_size`: the embedding engine's
    vectors before --dimensions; None when unknown, then the vectors are a list of any size)."""
    embed = spec.engine.task == "embed"
    own = own_names(spec)
    fields = [*HEAD, *((carried_name(name, own), pa.string() if kind is JSON_TEXT else kind)
                       for name, kind in column_types.items() if name != ID_COLUMN)]
    if spec.output.include_prompt:
        fields.append(("prompt", pa.string()))
    if embed:
        size = spec.embed.dimensions or vector_size
        value = ARROW_TYPES[spec.embed.embedding_dtype]
        fields += [("embedding", pa.list_(value) if size is None else pa.list_(value, size)),
                   ("prompt_tokens", pa.int32())]
    else:
        if spec.engine.lora:
            fields.append((ADAPTER_COLUMN, pa.string()))
        fields += [*RESULT_TAIL, *((name, COLUMN_TYPES[name]) for name in _asked_columns(spec))]
    return pa.schema(fields)


def own_names(spec: JobSpec) -> set[str]:
    """The names a job's results use for columns of their own (a carried column of one is `input_<name>`)."""
    return own_columns(EMBEDDING_COLUMNS if spec.engine.task == "embed" else RESULT_COLUMNS, spec.output.include_prompt)


def _asked_columns(spec: JobSpec) -> list[str]:
    """The optional generation columns (samples.py) that the job's own settings ask for."""
    sampling = spec.sampling
    constrained = any(getattr(sampling, name) is not None for name in ("json_schema", "choice", "regex", "grammar"))
    logprobs = sampling.logprobs or sampling.top_logprobs is not None
    asked = {"sample_index": sampling.n > 1, "parsed": constrained, "parse_error": constrained,
             "logprobs": logprobs, "choice_logprobs": logprobs and sampling.choice is not None}
    return [name for name in COLUMN_TYPES if asked[name]]


def to_manifest(schema: pa.Schema) -> str:
    """The schema as the manifest's `result_schema` records it."""
    return encode_schema(schema)


def from_manifest(result_schema: str | None) -> pa.Schema | None:
    """The schema a run recorded (its manifest's `result_schema`); None for folders written before the
    record (their parts decide)."""
    return decode_schema(result_schema) if isinstance(result_schema, str) else None


def empty_results(schema: pa.Schema) -> pl.LazyFrame:
    """No results, in the schema's columns and types (with the parts' source_index)."""
    frame = pl.DataFrame(schema.empty_table())
    return frame.lazy().with_columns(pl.lit(None, dtype=pl.Int32).alias("source_index"))


def conform(results: pl.LazyFrame, schema: pa.Schema) -> pl.LazyFrame:
    """The parts' rows in the schema's columns and order, a column no part holds null (no row asked
    for it, or none that did succeeded); the columns rows added on their own, and source_index, after."""
    types = pl.DataFrame(schema.empty_table()).schema
    present = results.collect_schema().names()
    wanted = [pl.col(name) if name in present else pl.lit(None, dtype=kind).alias(name) for name, kind in types.items()]
    added = sorted((name for name in present if name not in types), key=_canonical_position)
    return results.select(*wanted, *added)


def _canonical_position(name: str) -> int:
    """Where a column rows added goes: the optional columns in samples.py's order, then the others."""
    order = list(COLUMN_TYPES)
    return order.index(name) if name in order else len(order)
