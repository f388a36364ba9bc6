"""Final files: results.parquet and errors.parquet from the parts, and OpenAI-style JSONL.

Assembly streams through polars' lazy engine, so the results of a million
rows are never all in memory, and sorts them back into input order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl

from qbatch.output.folder import DUPLICATE_ID, ERROR_PREFIX, RESULT_PREFIX, OutputDir, atomic_write
from qbatch.records import ERROR_SCHEMA

ORDER = ["source_index", "row_index"]
JSONL_SLICE_ROWS = 10_000


def assemble(out: OutputDir, *, openai_jsonl: bool = False, result_parts: list[Path] | None = None,
             error_parts: list[Path] | None = None) -> dict[str, int]:
    """Write results.parquet / errors.parquet (and results.jsonl); return row counts.

    The parts default to OUT_DIR's own; `qbatch merge` passes those of several shards.
    """
    results = _scan(out.part_files(RESULT_PREFIX) if result_parts is None else result_parts)
    if results is None:
        results_frame = pl.LazyFrame(schema={"id": pl.String, "source_index": pl.Int32, "row_index": pl.Int64})
    else:
        # is_first_distinct looks at the id column alone: unique(subset="id") held every column
        # in its hash table (peak RSS 1.07 GB vs 0.46 GB for 1M rows, same output).
        results_frame = results.filter(pl.col("id").is_first_distinct()).sort(ORDER)
    atomic_write(out.path / "results.parquet",
                 lambda tmp: results_frame.drop("source_index").sink_parquet(tmp, compression="zstd"))

    errors = _scan(out.part_files(ERROR_PREFIX) if error_parts is None else error_parts)
    if errors is None:
        errors_frame = pl.from_arrow(ERROR_SCHEMA.empty_table()).lazy()
    else:
        ok_ids = pl.scan_parquet(out.path / "results.parquet").select("id", _ok=pl.lit(True))
        # A row retried with --retry-errors that now succeeded leaves its old error behind: drop it.
        # Duplicates dropped by --dedupe share their id with a result and stay.
        errors_frame = (errors.join(ok_ids, on="id", how="left")
                        .filter(pl.col("_ok").is_null() | (pl.col("error") == DUPLICATE_ID))
                        .drop("_ok")
                        .unique(subset=["id", "source", "row_index"], keep="last", maintain_order=True)
                        .sort(["source", "row_index"]))
    atomic_write(out.path / "errors.parquet", lambda tmp: errors_frame.sink_parquet(tmp, compression="zstd"))

    counts = {
        "rows_ok": pl.scan_parquet(out.path / "results.parquet").select(pl.len()).collect().item(),
        "rows_failed": pl.scan_parquet(out.path / "errors.parquet").select(pl.len()).collect().item(),
    }
    if openai_jsonl:
        write_openai_jsonl(out.path)
    return counts


def _scan(paths: list[Path]) -> pl.LazyFrame | None:
    if not paths:
        return None
    return pl.concat([pl.scan_parquet(p) for p in paths], how="diagonal_relaxed")


def write_openai_jsonl(folder: Path) -> None:
    """results.jsonl in the OpenAI Batch API output format, results then errors."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            for frame in pl.read_parquet(folder / "results.parquet").iter_slices(JSONL_SLICE_ROWS):
                for row in frame.iter_rows(named=True):
                    handle.write(json.dumps(_openai_ok(row), ensure_ascii=False) + "\n")
            for row in pl.read_parquet(folder / "errors.parquet").iter_rows(named=True):
                handle.write(json.dumps(_openai_error(row), ensure_ascii=False) + "\n")

    atomic_write(folder / "results.jsonl", write)


def _openai_ok(row: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": row["text"]}
    if row.get("reasoning") is not None:
        message["reasoning"] = row["reasoning"]
    usage = {"prompt_tokens": row["prompt_tokens"], "completion_tokens": row["completion_tokens"],
             "total_tokens": row["prompt_tokens"] + row["completion_tokens"]}
    body = {"id": f"chatcmpl-{row['id']}", "object": "chat.completion", "model": row.get("model"),
            "choices": [{"index": 0, "message": message, "finish_reason": row["finish_reason"]}], "usage": usage}
    return {"id": f"batch_req_{row['id']}", "custom_id": row["id"],
            "response": {"status_code": 200, "request_id": row["id"], "body": body}, "error": None}


def _openai_error(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"batch_req_{row['id']}", "custom_id": row["id"], "response": None,
            "error": {"code": row["error"], "message": row["message"]}}
