"""results.parquet's columns and types come from the job, never from which rows succeeded: a day
whose rows all failed writes a file that concatenates with the other days' (polars, DuckDB)."""

from __future__ import annotations

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

GENERATE_JOBS = {
    "plain": [],
    "constrained samples with logprobs": ["--choice", "yes,no", "--n", "2", "--top-logprobs", "2",
                                          "--include-prompt"],
    "json schema": ["--json-schema", '{"type": "object"}', "--logprobs"],
}


def _day(rows_ok: bool, day: int) -> list[dict]:
    """A day's rows, with carried columns of every kind; rows with an empty prompt fail (empty_prompt)."""
    return [{"id": f"d{day}-{i}", "prompt": "hello there" if rows_ok else "", "topic": i,
             "meta": {"a": i, "b": "x"}, "tags": ["t"], "score": 0.5} for i in range(3)]


def _two_days(run, write_jsonl, tmp_path, *args) -> tuple[str, str]:
    folders = []
    for day, rows_ok in ((1, True), (2, False)):
        out = tmp_path / f"day{day}"
        result = run(write_jsonl(_day(rows_ok, day), f"day{day}.jsonl"), "-o", out, *args)
        assert result.exit_code == 0, result.output
        folders.append(str(out / "results.parquet"))
    return folders[0], folders[1]


def _check_concatenate(ok: str, failed: str) -> None:
    assert pl.read_parquet(failed).height == 0 and pl.read_parquet(ok).height > 0
    assert pq.read_schema(failed).equals(pq.read_schema(ok))
    both = pl.concat([pl.read_parquet(ok), pl.read_parquet(failed)])
    assert both.height == pl.read_parquet(ok).height
    assert duckdb.sql(f"select count(*) from read_parquet(['{ok}', '{failed}'])").fetchall() == [(both.height,)]


@pytest.mark.parametrize("job", GENERATE_JOBS)
def test_a_day_whose_rows_all_failed_concatenates_with_the_others(cli, bundled_model, write_jsonl, tmp_path, job):
    def run(*args):
        return cli("run", *args, "--model", bundled_model, "--backend", "null", "--progress", "none",
                   "--max-tokens", "4")

    _check_concatenate(*_two_days(run, write_jsonl, tmp_path, *GENERATE_JOBS[job]))


@pytest.mark.parametrize("args", [[], ["--dimensions", "32", "--embedding-dtype", "float16", "--include-prompt"]])
def test_an_embedding_day_whose_rows_all_failed_concatenates(cli, bundled_model, write_jsonl, tmp_path, args):
    def run(*more):
        return cli("embed", *more, "--model", bundled_model, "--backend", "null", "--progress", "none")

    _check_concatenate(*_two_days(run, write_jsonl, tmp_path, *args))


def test_columns_rows_ask_for_keep_one_order_whatever_the_chunks(cli, bundled_model, write_jsonl, tmp_path):
    # Rows asking on their own for samples and a constraint, in chunks of one row: the columns they
    # add come in one order (samples.py's), whichever chunk wrote them first.
    rows = [{"id": "c", "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}},
            {"id": "n", "prompt": "a longer prompt " * 8, "n": 2}]
    path, columns = write_jsonl(rows), []
    for order in ("input", "longest-first"):
        out = tmp_path / order
        result = cli("run", path, "-o", out, "--model", bundled_model, "--backend", "null", "--progress", "none",
                     "--max-tokens", "4", "--order", order, "--chunk-tokens", "16")
        assert result.exit_code == 0, result.output
        columns.append(pl.read_parquet(out / "results.parquet").columns)
    assert columns[0] == columns[1]
    assert columns[0][-3:] == ["sample_index", "parsed", "parse_error"]


def test_a_merge_of_shards_whose_rows_all_failed_has_the_jobs_columns(cli, bundled_model, write_jsonl, tmp_path):
    path = write_jsonl([{"id": f"r{i}", "prompt": "", "topic": i} for i in range(6)])
    outs = []
    for shard in ("0/2", "1/2"):
        outs.append(tmp_path / shard.replace("/", "of"))
        result = cli("run", path, "-o", outs[-1], "--model", bundled_model, "--backend", "null", "--progress", "none",
                     "--shard", shard, "--n", "2")
        assert result.exit_code == 0, result.output
    result = cli("merge", *outs, "-o", tmp_path / "all")
    assert result.exit_code == 0, result.output
    merged = pl.read_parquet(tmp_path / "all" / "results.parquet")
    assert merged.height == 0 and merged.columns == [
        "id", "source", "row_index", "prompt", "topic", "text", "reasoning", "finish_reason", "flag", "prompt_tokens",
        "completion_tokens", "cached_tokens", "sample_index"]
