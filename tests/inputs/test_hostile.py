"""The hostile-input corpus (tests/hostile/): every bad row ends in errors.parquet with a
reason, every unreadable file stops with a message and exit code, and nothing is lost."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from qbatch.errors import EXIT_INPUT

HOSTILE = Path(__file__).parents[1] / "hostile"


@pytest.fixture
def run_null(cli, bundled_model):
    def run(*args):
        return cli("run", "--model", bundled_model, "--backend", "null", "--progress", "none",
                   "--max-model-len", "2048", *args)

    return run


ROW_CASES = {
    "malformed.jsonl": {"malformed.jsonl#1": "bad_line"},
    "invalid_utf8.jsonl": {"invalid_utf8.jsonl#1": "bad_line"},
    "top_level_array.jsonl": {"top_level_array.jsonl#1": "bad_line", "top_level_array.jsonl#2": "bad_line"},
    "wrong_types.jsonl": {"int_prompt": "bad_prompt", "list_prompt": "bad_prompt", "str_temp": "bad_param",
                          "float_max": "bad_param", "bool_max": "bad_param", "int_stop": "bad_param",
                          "str_think": "bad_param", "params_list": "bad_param", "unknown_param": "bad_param"},
    "bad_messages.jsonl": {"not_list": "bad_messages", "empty_list": "bad_messages", "no_role": "bad_messages",
                           "bad_role": "bad_messages", "dict_content": "bad_messages",
                           "empty_content": "empty_prompt", "image_part": "bad_messages"},
    "missing_prompt.jsonl": {"a": "missing_prompt", "b": "empty_prompt", "c": "empty_prompt"},
    "openai_bad.jsonl": {"bad_url": "unsupported_url", "no_body": "bad_body", "n2": "bad_param", "bad_schema": "bad_constraint"},
    "over_context.jsonl": {"long": "prompt_too_long"},
}


@pytest.mark.parametrize("name", sorted(ROW_CASES))
def test_bad_rows_are_recorded_with_reasons(name, run_null, tmp_path):
    out = tmp_path / "out"
    result = run_null(HOSTILE / name, "-o", out, "--on-bad-line", "skip")
    assert result.exit_code == 0, result.output
    ok = pl.read_parquet(out / "results.parquet")
    errors = pl.read_parquet(out / "errors.parquet")
    assert dict(zip(errors["id"], errors["error"])) == ROW_CASES[name]
    assert errors["message"].str.len_chars().min() > 10
    total_lines = sum(1 for line in (HOSTILE / name).read_bytes().splitlines() if line.strip())
    assert len(ok) + len(errors) == total_lines  # nothing lost
    assert set(ok["id"]).isdisjoint(errors["id"])  # nothing doubled


def test_messages_say_how_to_fix(run_null, tmp_path):
    run_null(HOSTILE / "wrong_types.jsonl", "-o", tmp_path / "out")
    errors = pl.read_parquet(tmp_path / "out" / "errors.parquet")
    messages = dict(zip(errors["id"], errors["message"]))
    assert messages["str_temp"] == "temperature must be a number, got 'hot'"
    assert messages["unknown_param"] == "unknown sampling parameter 'temprature'"
    run_null(HOSTILE / "invalid_utf8.jsonl", "-o", tmp_path / "out2", "--on-bad-line", "skip")
    errors = pl.read_parquet(tmp_path / "out2" / "errors.parquet")
    assert errors.row(0, named=True) | {"source": None} == {
        "id": "invalid_utf8.jsonl#1", "source": None, "row_index": 1, "line": 2, "error": "bad_line",
        "message": "line is not valid UTF-8 (byte offset 26)"}


FILE_CASES = [
    ("not_parquet.parquet", EXIT_INPUT, "not a readable Parquet file"),
    ("not_gzip.jsonl.gz", EXIT_INPUT, "cannot read compressed input"),
    ("duplicate_ids.jsonl", EXIT_INPUT, "2 ids appear more than once: 'a', 'b'"),
    ("malformed.jsonl", EXIT_INPUT, "line is not valid JSON"),
]


@pytest.mark.parametrize(("name", "code", "message"), FILE_CASES)
def test_unreadable_files_stop_with_a_message(name, code, message, run_null, tmp_path):
    result = run_null(HOSTILE / name, "-o", tmp_path / "out")
    assert result.exit_code == code, result.output
    assert result.stderr.startswith("Error: ") and message in result.stderr
    assert "Hint: " in result.stderr or name != "malformed.jsonl"
    assert "Traceback" not in result.output


@pytest.mark.parametrize("name", ["empty.jsonl", "blank_lines.jsonl"])
def test_empty_inputs_finish_cleanly_and_say_so(name, run_null, tmp_path):
    out = tmp_path / "out"
    result = run_null(HOSTILE / name, "-o", out, "--progress", "log")
    assert result.exit_code == 0, result.output
    assert "no rows to process" in result.stderr
    assert pl.read_parquet(out / "results.parquet").height == 0


def test_folder_given_as_input_file(run_null, tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "dir.jsonl" / "x.txt").write_text("")
    result = run_null(tmp_path / "dir.jsonl", "-o", tmp_path / "out")
    assert result.exit_code == EXIT_INPUT and "folder holds no .jsonl/.ndjson/.parquet files" in result.stderr
