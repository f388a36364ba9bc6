"""Final files: results.parquet and errors.parquet from the parts, and OpenAI-style JSONL.

Assembly streams through polars' lazy engine, so the results of a million
rows are never all in memory, and sorts them back into input order.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from qbatch._fs import atomic_write
from qbatch.output.embeddings import openai_embedding
from qbatch.output.flags import FLAGS
from qbatch.output.ranges import sink_by_ranges
from qbatch.output.folder import DUPLICATE_ID, ERROR_PREFIX, RESULT_PREFIX, OutputDir
from qbatch.output.reading import PART_HINT, reading
from qbatch.output.schema import conform, empty_results
from qbatch.output.manifest import Manifest
from qbatch.output.schema import from_manifest as result_schema_of
from qbatch.output.tables import ERROR_SCHEMA

JSONL_SLICE_ROWS = 10_000
COMPLETIONS_URL = "/v1/completions"
STAND_IN_ID_ERRORS = ("missing_id", "bad_line")  # error rows whose id qbatch made up: the request's key is unknown


@dataclass(frozen=True)
class Assembled:
    """What results.parquet and errors.parquet hold once assembled."""

    rows_ok: int  # ids (input rows) with results
    rows_failed: int
    samples_ok: int  # result rows: rows_ok, or more with n > 1 (a result row a sample)
    flags: dict[str, int]  # result rows by flag (output/flags.py)

    @property
    def counts(self) -> dict[str, int]:
        """As the manifest's `counts` records them: samples_ok only where it differs from rows_ok."""
        counts = {"rows_ok": self.rows_ok, "rows_failed": self.rows_failed}
        return counts if self.samples_ok == self.rows_ok else {**counts, "samples_ok": self.samples_ok}


def assemble(out: OutputDir, *, openai_jsonl: bool = False, result_parts: list[Path] | None = None,
             error_parts: list[Path] | None = None, model: str | None = None,
             manifest: Manifest | None = None) -> Assembled:
    """Write results.parquet / errors.parquet (and results.jsonl); return row counts.

    The parts default to OUT_DIR's own; `qbatch merge` passes those of several shards, and the
    `manifest` of the first (default: OUT_DIR's), whose recorded schema the results take (schema.py).
    `model` (the job's --model as given) is the `model` of results.jsonl's responses.
    """
    recorded = out.manifest() if manifest is None else manifest
    schema = result_schema_of(recorded.result_schema if recorded is not None else None)
    parts = out.whole_part_files(RESULT_PREFIX) if result_parts is None else result_parts
    atomic_write(out.path / "results.parquet", lambda tmp: _sink_results(parts, schema, tmp))

    errors = _scan(out.whole_part_files(ERROR_PREFIX) if error_parts is None else error_parts)
    if errors is None:
        errors_frame = pl.DataFrame(ERROR_SCHEMA.empty_table()).lazy()
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

    # rows_ok counts ids (input rows); with n > 1 (a result row a sample) samples_ok counts result rows.
    # results.parquet holds each id's samples once, the first numbered 0: its ids are its rows of sample 0
    # (counted streaming, where n_unique would hash every id)
    written = pl.scan_parquet(out.path / "results.parquet")
    samples = "sample_index" in written.collect_schema().names()
    first = (pl.col("sample_index").fill_null(0) == 0).sum() if samples else pl.len()
    num_ids, num_samples = written.select(first.alias("ids"), pl.len().alias("rows")).collect().row(0)
    num_failed = pl.scan_parquet(out.path / "errors.parquet").select(pl.len()).collect().item()
    if openai_jsonl:
        write_openai_jsonl(out.path, model)
    return Assembled(num_ids, num_failed, num_samples, flag_counts(out.path / "results.parquet"))


def flag_counts(path: Path) -> dict[str, int]:
    """results.parquet's rows by flag (flags.py), in the flags' order; none for results without the column."""
    frame = pl.scan_parquet(path)
    if "flag" not in frame.collect_schema().names():
        return {}
    counts = dict(frame.group_by("flag").len().drop_nulls("flag").collect().iter_rows())
    return {flag: counts[flag] for flag in FLAGS if counts.get(flag)}


def _sink_results(parts: list[Path], schema: Any, path: Path) -> None:
    """The results in input order, each id (with n > 1: each id and sample) once, a range of input rows
    at a time (ranges.py): the assembly's memory does not grow with the job. Parts hold whole rows
    (every sample of an id, written together), so a redone chunk repeats all of an id's samples and
    the first copy of each is kept."""
    if not parts:
        frame = empty_results(schema) if schema is not None else pl.LazyFrame(
            schema={"id": pl.String, "source_index": pl.Int32, "row_index": pl.Int64})
        frame.drop("source_index").sink_parquet(path, compression="zstd")
        return

    def frame_of(paths: list[Path]) -> pl.LazyFrame:
        return _concat(paths)

    sink_by_ranges(parts, frame_of, path, conform=None if schema is None else lambda frame: conform(frame, schema))


def _scan(paths: list[Path], *, check: bool = True) -> pl.LazyFrame | None:
    """The parts as one frame; a part that cannot be read is an OutputError naming it (footers read here,
    unless `check` is off: read before)."""
    import pyarrow.parquet as pq

    if not paths:
        return None
    for path in paths if check else ():
        with reading(path, PART_HINT):
            pq.ParquetFile(path).close()
    return _concat(paths)


def _concat(paths: list[Path]) -> pl.LazyFrame:
    return pl.concat([pl.scan_parquet(p) for p in paths], how="diagonal_relaxed")


def write_openai_jsonl(folder: Path, model: str | None = None, *, results_path: Path | None = None,
                       errors_path: Path | None = None) -> None:
    """results.jsonl in the OpenAI Batch API output format, results then errors.

    A row that came from a `/v1/completions` request (its carried `url` column) gets a
    `text_completion` object, as OpenAI's completions API returns; any other a `chat.completion`.
    With `errors_path` the errors go to a file of their own (the Batch API's output and error
    files, as `qbatch serve` hands them out); `results_path` replaces folder/results.jsonl.
    """
    created = int(time.time())

    def write_results(handle: Any) -> None:
        for rows in _by_id(_slices(folder / "results.parquet")):
            handle.write(json_line(_openai_ok(rows, model, created)))

    def write_errors(handle: Any) -> None:
        for row in pl.read_parquet(folder / "errors.parquet").iter_rows(named=True):
            handle.write(json_line(_openai_error(row)))

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            write_results(handle)
            if errors_path is None:
                write_errors(handle)

    atomic_write(results_path or folder / "results.jsonl", write)
    if errors_path is not None:
        atomic_write(errors_path, lambda tmp: _write_with(tmp, write_errors))


def json_line(obj: dict[str, Any]) -> str:
    """One JSONL line, non-ASCII escaped: a model's text may hold U+2028, U+0085 and other characters
    that str.splitlines() (how many clients split a downloaded file) takes for line ends."""
    return json.dumps(obj) + "\n"


def _write_with(path: Path, write: Any) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        write(handle)


def _slices(path: Path) -> Any:
    """The rows of a Parquet file, JSONL_SLICE_ROWS at a time (a million embeddings are 4 GB)."""
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(JSONL_SLICE_ROWS):
        yield pl.from_arrow(batch)


def _by_id(slices: Any) -> Any:
    """The result rows of each id together (its samples: assembly keeps them adjacent, in order)."""
    group: list[dict[str, Any]] = []
    for slice_ in slices:
        for row in slice_.iter_rows(named=True):
            if group and row["id"] != group[0]["id"]:
                yield group
                group = []
            group.append(row)
    if group:
        yield group


def _openai_ok(rows: list[dict[str, Any]], model: str | None, created: int) -> dict[str, Any]:
    """One response for an id: a choice a sample. The content is `parsed` when the answer parsed
    (the JSON re-serialized, or the choice), else the text."""
    row = rows[0]
    if "embedding" in row:  # qbatch embed: OpenAI's embeddings response
        return {"id": f"batch_req_{row['id']}", "custom_id": row["id"],
                "response": {"status_code": 200, "request_id": row["id"], "body": openai_embedding(row, model)},
                "error": None}
    completion_tokens = sum(r["completion_tokens"] for r in rows)
    usage = {"prompt_tokens": row["prompt_tokens"], "completion_tokens": completion_tokens,
             "total_tokens": row["prompt_tokens"] + completion_tokens}
    if row.get("url") == COMPLETIONS_URL:
        choices: list[dict[str, Any]] = [
            {"index": r.get("sample_index") or 0, "text": r["text"], "finish_reason": r["finish_reason"],
             "logprobs": _completion_logprobs(r.get("logprobs"))} for r in rows]
        body = {"id": f"cmpl-{row['id']}", "object": "text_completion", "created": created,
                "model": row.get("adapter") or model,  # a LoRA adapter's rows name it, as vLLM's server does
                "choices": choices, "usage": usage}
    else:
        choices = []
        for r in rows:
            parsed = r.get("parsed")
            message: dict[str, Any] = {"role": "assistant", "content": r["text"] if parsed is None else parsed}
            if r.get("reasoning") is not None:
                message["reasoning"] = r["reasoning"]
            logprobs = r.get("logprobs")
            choices.append({"index": r.get("sample_index") or 0, "message": message,
                            "finish_reason": r["finish_reason"],
                            "logprobs": None if logprobs is None else {"content": [_chat_token(t) for t in logprobs],
                                                                       "refusal": None}})
        body = {"id": f"chatcmpl-{row['id']}", "object": "chat.completion", "created": created,
                "model": row.get("adapter") or model,  # a LoRA adapter's rows name it, as vLLM's server does
                "choices": choices, "usage": usage}
    return {"id": f"batch_req_{row['id']}", "custom_id": row["id"],
            "response": {"status_code": 200, "request_id": row["id"], "body": body}, "error": None}


def openai_body(rows: list[dict[str, Any]], model: str | None, created: int) -> dict[str, Any]:
    """The response body of one id's result rows (its samples, in order), as a batch's output line holds
    it: the online routes (serve/online.py) answer with the same object."""
    body: dict[str, Any] = _openai_ok(rows, model, created)["response"]["body"]
    return body


def _openai_error(row: dict[str, Any]) -> dict[str, Any]:
    # A request without a readable custom_id has only the stand-in id qbatch gave its error row: report none.
    custom_id = None if row["error"] in STAND_IN_ID_ERRORS else row["id"]
    return {"id": f"batch_req_{row['id']}", "custom_id": custom_id, "response": None,
            "error": {"code": row["error"], "message": row["message"]}}


def _chat_token(token: dict[str, Any]) -> dict[str, Any]:
    """A token's logprobs as OpenAI's chat completions give them (with the UTF-8 bytes of each token)."""
    return {"token": token["token"], "logprob": token["logprob"], "bytes": list(token["token"].encode()),
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode())}
                             for t in token["top_logprobs"] or []]}


def _completion_logprobs(tokens: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """Logprobs as OpenAI's (legacy) completions API gives them: parallel lists."""
    if tokens is None:
        return None
    offsets, offset = [], 0
    for t in tokens:
        offsets.append(offset)
        offset += len(t["token"])
    return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [{a["token"]: a["logprob"] for a in t["top_logprobs"] or []} for t in tokens],
            "text_offset": offsets}
