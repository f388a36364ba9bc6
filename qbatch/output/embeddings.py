"""Embedding results: the model's vectors finished (Matryoshka truncation, normalization, dtype) and
one chunk's rows as an Arrow table, and the OpenAI embeddings response of a result row.

Engines return the model's pooled vectors whole and unnormalized (vLLM's pooler with its activation
off, or the null engine's), and every vector is finished here, in one place, the same way whatever
the engine: keep the first `dimensions` values, then scale to unit L2 norm. Truncating a normalized
vector and normalizing again gives the same vector, so nothing depends on what the engine did.

Columns: id, source, source_index (dropped at assembly), row_index, the carried input columns (one
named like a column below is `input_<name>`), prompt (optional), `embedding` (a FixedSizeList of
float32 or float16: polars reads it as an Array, DuckDB and LanceDB as vectors) and prompt_tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from qbatch.output.tables import carried_columns, own_columns
from qbatch.errors import SpecError
from qbatch.records import Embedding
from qbatch.spec import EmbedSpec

ARROW_TYPES = {"float32": pa.float32(), "float16": pa.float16()}


def finish_vectors(vectors: np.ndarray, settings: EmbedSpec) -> np.ndarray:
    """Rows of vectors truncated to `dimensions`, normalized (a zero vector stays zero), in the output dtype."""
    out = np.asarray(vectors, dtype=np.float32)
    if settings.dimensions is not None and settings.dimensions > out.shape[1]:
        raise SpecError(f"dimensions must be at most the model's embedding size {out.shape[1]}, got "
                        f"{settings.dimensions}", where="--dimensions", hint=f"pass --dimensions N <= {out.shape[1]}")
    if settings.dimensions is not None:
        out = out[:, :settings.dimensions]
    if settings.normalize:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out = out / np.where(norms > 0, norms, 1.0)
    return out.astype(np.dtype(settings.embedding_dtype), copy=False)


def embeddings_table(embeddings: list[Embedding], sources: list[str], settings: EmbedSpec, *, include_prompt: bool,
                     column_types: dict[str, pa.DataType | None] | None = None) -> pa.Table:
    """One chunk's embeddings as an Arrow table (rows the engine refused are not passed here)."""
    requests = [e.request for e in embeddings]
    columns: dict[str, Any] = {
        "id": pa.array([r.id for r in requests], type=pa.string()),
        "source": pa.array([sources[r.source_index] for r in requests], type=pa.string()),
        "source_index": pa.array([r.source_index for r in requests], type=pa.int32()),
        "row_index": pa.array([r.row_index for r in requests], type=pa.int64()),
    }
    columns.update(carried_columns(requests, column_types, own=own_columns(EMBEDDING_COLUMNS, include_prompt)))
    if include_prompt:
        columns["prompt"] = pa.array([r.prompt for r in requests], type=pa.string())
    columns["embedding"] = vector_array(np.stack([e.vector for e in embeddings]), settings)
    columns["prompt_tokens"] = pa.array([r.num_prompt_tokens for r in requests], type=pa.int32())
    return pa.table(columns)


EMBEDDING_COLUMNS = {"id", "source", "source_index", "row_index", "prompt", "embedding", "prompt_tokens"}


def vector_array(vectors: np.ndarray, settings: EmbedSpec) -> pa.FixedSizeListArray:
    """Finished vectors as one FixedSizeList array (one buffer, no per-row Python lists)."""
    finished = finish_vectors(vectors, settings)
    values = pa.array(finished.reshape(-1), type=ARROW_TYPES[settings.embedding_dtype])
    return pa.FixedSizeListArray.from_arrays(values, finished.shape[1])


def openai_embedding(row: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The body of OpenAI's embeddings response for one result row (one input a request)."""
    vector = [float(v) for v in row["embedding"]]
    return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": vector}], "model": model,
            "usage": {"prompt_tokens": row["prompt_tokens"], "total_tokens": row["prompt_tokens"]}}
