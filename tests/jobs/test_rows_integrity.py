"""Row integrity with the null engine: carried column types, ids, OpenAI output lines, empty inputs.

A result must not depend on how rows were chunked, an id must never be made up
where it could clash with a real one, and nothing ends silently.
"""

from __future__ import annotations

import json

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qbatch.errors import EXIT_INPUT

MIXED_ROWS = [
    {"id": "a", "prompt": "one", "meta": {"a": 4, "b": None}},
    {"id": "b", "prompt": "two", "meta": {"a": 1, "b": "x"}},
    {"id": "c", "prompt": "three", "meta": "plain"},
]



def _results(out) -> pa.Table:
    return pq.read_table(out / "results.parquet")


# -- carried columns ---------------------------------------------------------
def test_mixed_column_is_json_text_whatever_the_chunking(run_null, write_jsonl, tmp_path, monkeypatch):
    monkeypatch.setattr("qbatch.jobs.parts.PART_MIN_S", 0.0)  # a part at each chunk's end
    path = write_jsonl(MIXED_ROWS)
    assert run_null(path, "-o", tmp_path / "big").exit_code == 0
    result = run_null(path, "-o", tmp_path / "small", "--chunk-tokens", 1, "--sort-window", 1)
    assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "small" / "parts").glob("part-*.parquet"))) == 3  # one row per part
    big, small = _results(tmp_path / "big"), _results(tmp_path / "small")
    assert big.schema.field("meta").type == small.schema.field("meta").type == pa.large_string()
    assert big.column("meta").to_pylist() == small.column("meta").to_pylist()
    assert [json.loads(v) for v in small.column("meta").to_pylist()] == [row["meta"] for row in MIXED_ROWS]
    assert big.drop(["text"]).equals(small.drop(["text"]))


def test_consistent_nested_column_keeps_its_type_in_every_part(run_null, write_jsonl, tmp_path):
    rows = [{"id": "a", "prompt": "one", "meta": {"a": 4, "b": None}, "score": 1},
            {"id": "b", "prompt": "two", "meta": {"a": 1, "b": "x"}, "score": 2.5}]
    result = run_null(write_jsonl(rows), "-o", tmp_path / "out", "--chunk-tokens", 1, "--sort-window", 1)
    assert result.exit_code == 0, result.output
    table = pl.read_parquet(tmp_path / "out" / "results.parquet")
    assert table.schema["meta"] == pl.Struct({"a": pl.Int64, "b": pl.String}) and table.schema["score"] == pl.Float64
    assert table["meta"].to_list() == [row["meta"] for row in rows]


def test_parquet_struct_column_keeps_its_type_and_every_reader_reads_it(run_null, tmp_path):
    meta_type = pa.struct([("a", pa.int32()), ("b", pa.string())])
    table = pa.table({"id": ["a", "b", "c"], "prompt": ["one", "two", "three"],
                      "meta": pa.array([{"a": 4, "b": None}, None, {"a": 1, "b": "x"}], type=meta_type)})
    pq.write_table(table, tmp_path / "in.parquet")
    out = tmp_path / "out"
    result = run_null(tmp_path / "in.parquet", "-o", out, "--chunk-tokens", 1, "--sort-window", 1)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet").schema["meta"] == pl.Struct({"a": pl.Int32, "b": pl.String})
    import duckdb
    import pandas as pd

    assert pl.read_parquet(out / "results.parquet")["meta"].to_list()[0] == {"a": 4, "b": None}
    assert pd.read_parquet(out / "results.parquet")["id"].tolist() == ["a", "b", "c"]
    assert duckdb.sql(f"select meta.a from '{out}/results.parquet' order by row_index").fetchall() == [(4,), (None,), (1,)]


def test_a_resumed_run_writes_the_types_decided_on_the_whole_input(run_null, write_jsonl, tmp_path):
    path = write_jsonl(MIXED_ROWS)
    out = tmp_path / "out"
    assert run_null(path, "-o", out, "--limit", 2).exit_code == 0  # the first two rows alone agree on a struct
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["columns"]["meta"] == "struct<a: int64, b: string>"
    # the third row makes the column mixed: the resumed run widens it to JSON text, the earlier parts too
    # (output/widening.py), as a first run on the whole input decides
    result = run_null(path, "-o", out)
    assert result.exit_code == 0, result.output
    resumed = pl.read_parquet(out / "results.parquet")
    assert resumed.schema["meta"] == pl.String and resumed.height == len(MIXED_ROWS)
    result = run_null(path, "-o", tmp_path / "first")
    assert pl.read_parquet(tmp_path / "first" / "results.parquet")["meta"].to_list() == resumed["meta"].to_list()


# -- ids ---------------------------------------------------------------------
def test_float_ids_become_integer_text_and_missing_ids_are_error_rows(run_null, tmp_path):
    pl.DataFrame({"id": [10.0, 20.5, None], "prompt": ["a", "b", "c"]}).write_parquet(tmp_path / "f.parquet")
    out = tmp_path / "out"
    result = run_null(tmp_path / "f.parquet", "-o", out)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["10", "20.5"]
    errors = pl.read_parquet(out / "errors.parquet")
    assert errors["error"].to_list() == ["missing_id"] and errors["row_index"].to_list() == [2]
    assert "'id' is null" in errors["message"][0] and "f.parquet" in errors["source"][0]
    result = run_null(tmp_path / "f.parquet", "-o", tmp_path / "out2", "--id-column", "id")
    assert pl.read_parquet(tmp_path / "out2" / "results.parquet")["id"].to_list() == ["10", "20.5"]


def test_a_null_id_never_falls_back_to_a_position_that_clashes(run_null, tmp_path):
    pl.DataFrame({"id": [1, 2, None], "prompt": ["a", "b", "c"]}).write_parquet(tmp_path / "i.parquet")
    out = tmp_path / "out"
    result = run_null(tmp_path / "i.parquet", "-o", out)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["1", "2"]
    errors = pl.read_parquet(out / "errors.parquet")
    assert errors["error"].to_list() == ["missing_id"]
    assert errors["id"].to_list() != ["2"]


# -- OpenAI batch lines ------------------------------------------------------
def test_openai_line_without_custom_id_and_completions_objects(run_null, write_jsonl, tmp_path, bundled_model):
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}},
             {"custom_id": "t", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once", "max_tokens": 2}},
             {"method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}]}}]
    out = tmp_path / "out"
    result = run_null(write_jsonl(lines), "-o", out, "--output-format", "jsonl-openai")
    assert result.exit_code == 0, result.output
    errors = pl.read_parquet(out / "errors.parquet")
    assert errors["error"].to_list() == ["missing_id"] and errors["line"].to_list() == [3]
    assert "custom_id" in errors["message"][0]
    chat, text, error = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert error["custom_id"] is None and "custom_id" in error["error"]["message"]
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert text["response"]["body"]["object"] == "text_completion"
    assert text["response"]["body"]["choices"][0]["text"].startswith("[null engine")
    assert chat["response"]["body"]["model"] == text["response"]["body"]["model"] == bundled_model
    openai_types = pytest.importorskip("openai.types")
    openai_types.chat.ChatCompletion.model_validate(chat["response"]["body"])
    openai_types.Completion.model_validate(text["response"]["body"])


# -- empty inputs ------------------------------------------------------------
def test_an_empty_input_warns_and_fails_on_request(run_null, write_jsonl, tmp_path):
    path = write_jsonl([], "empty.jsonl")
    result = run_null(path, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "empty.jsonl" in result.stderr and "0 rows" in result.stderr
    result = run_null(path, "-o", tmp_path / "out2", "--fail-on-empty")
    assert result.exit_code == EXIT_INPUT, result.output
    assert "Error: the inputs hold 0 rows" in result.output and "Hint:" in result.output
