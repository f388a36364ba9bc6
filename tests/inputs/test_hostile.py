"""The hostile-input corpus (tests/hostile/): every bad row ends in errors.parquet with a
reason, every unreadable file stops with a message and exit code, and nothing is lost."""

from __future__ import annotations

import json
import re
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from qbatch.errors import EXIT_INPUT, EXIT_MISMATCH

HOSTILE = Path(__file__).parents[1] / "hostile"


@pytest.fixture
def run_null(cli, bundled_model):
    def run(*args):
        return cli("run", "--model", bundled_model, "--backend", "null", "--progress", "none",
                   "--max-model-len", "2048", *args)

    return run


ROW_CASES = {
    "malformed.jsonl": {"malformed.jsonl#1": "bad_line"},
    "invalid_utf8.jsonl": {"b": "bad_text"},
    "lone_surrogates.jsonl": {"in_prompt": "bad_text", "lone_surrogates.jsonl#2": "missing_id", "in_column": "bad_text",
                              "in_message": "bad_text", "in_key": "bad_text", "nested": "bad_text"},
    "invalid_utf8.parquet": {"bad_prompt": "bad_text", "invalid_utf8.parquet#2": "missing_id",
                             "bad_column": "bad_text"},
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
    "records.json": {"records.json#1": "bad_line", "records.json#3": "bad_line", "records.json#4": "bad_line"},
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
    assert len(ok) + len(errors) == num_rows(HOSTILE / name)  # nothing lost
    assert set(ok["id"]).isdisjoint(errors["id"])  # nothing doubled


def num_rows(path: Path) -> int:
    if path.suffix == ".parquet":
        return pq.ParquetFile(path).metadata.num_rows
    if path.suffix == ".json":
        return 6  # records.json's elements
    return sum(1 for line in path.read_bytes().splitlines() if line.strip())


def test_messages_say_how_to_fix(run_null, tmp_path):
    run_null(HOSTILE / "wrong_types.jsonl", "-o", tmp_path / "out")
    errors = pl.read_parquet(tmp_path / "out" / "errors.parquet")
    messages = dict(zip(errors["id"], errors["message"]))
    assert messages["str_temp"] == "temperature must be a number, got 'hot'"
    assert messages["unknown_param"] == "unknown sampling parameter 'temprature'"
    run_null(HOSTILE / "invalid_utf8.jsonl", "-o", tmp_path / "out2", "--on-bad-line", "skip")
    errors = pl.read_parquet(tmp_path / "out2" / "errors.parquet")
    assert errors.row(0, named=True) | {"source": None} == {
        "id": "b", "source": None, "row_index": 1, "line": 2, "error": "bad_text",
        "message": "line is not valid UTF-8 (byte offset 26, in 'prompt'); save the file as UTF-8"}


FILE_CASES = [
    ("not_parquet.parquet", EXIT_INPUT, "not a readable Parquet file"),
    ("not_gzip.jsonl.gz", EXIT_INPUT, "cannot read compressed input"),
    ("duplicate_ids.jsonl", EXIT_INPUT,
     "2 ids appear more than once: 'a' (duplicate_ids.jsonl:1, duplicate_ids.jsonl:3), 'b' (duplicate_ids.jsonl:2, "
     "duplicate_ids.jsonl:4)"),
    ("malformed.jsonl", EXIT_INPUT, "line is not valid JSON"),
    ("records.json", EXIT_INPUT, "Error: array element is JSON int, expected an object (", "records.json:6)"),
    ("truncated_array.json", EXIT_INPUT, "Error: the JSON array ends before its closing ']': the file is cut short "
                                         "(it ends inside element 3, which starts at line 10) (", "truncated_array.json:10)"),
    ("trailing.json", EXIT_INPUT, "Error: the file goes on after the JSON array's closing ']' (", "trailing.json:2)"),
    ("object.json", EXIT_INPUT, "Error: the file's first line is a JSON object spread over several lines, not one object "
                                "a line (", "object.json:1)"),
    ("scalar.json", EXIT_INPUT, "Error: the file's first line is JSON int, not an object or an array of objects (",
     "scalar.json:1)"),
    ("array.jsonl", EXIT_INPUT, "Error: the file holds a JSON array ('[' at its start), not JSONL (one object a line) (",
     "array.jsonl:1)\nHint: name it .json to read the array's objects as rows"),
]
ARRAY_HINT = "Hint: qbatch reads JSONL (one object a line), a JSON array of objects (a .json file) and Parquet"


@pytest.mark.parametrize(("name", "code", "message", "where"), [(*case, None)[:4] for case in FILE_CASES])
def test_unreadable_files_stop_with_a_message(name, code, message, where, run_null, tmp_path):
    result = run_null(HOSTILE / name, "-o", tmp_path / "out")
    assert result.exit_code == code, result.output
    assert result.stderr.startswith("Error: ") and message in result.stderr
    assert "Hint: " in result.stderr or name != "malformed.jsonl"
    assert "Traceback" not in result.output
    if where:  # the file and line, then the hint
        assert where in result.stderr
    if name.endswith(".json") and "element" not in message:
        assert ARRAY_HINT in result.stderr


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


def test_text_that_is_not_unicode_fails_its_row_alone(run_null, tmp_path):
    """Lone surrogate escapes (valid JSON, not text) and bytes that are not UTF-8, anywhere in a row (prompt,
    message, id, carried column, key, nested value): that row is an error row with its line, whatever
    --on-bad-line says; a row whose id is the bad text gets a stand-in id. A valid pair and NUL run."""
    out = tmp_path / "out"
    result = run_null(HOSTILE / "lone_surrogates.jsonl", "-o", out)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert sorted(pl.read_parquet(out / "results.parquet")["id"]) == ["nul", "ok", "pair"]
    errors = pl.read_parquet(out / "errors.parquet")
    by_id = {row["id"]: row for row in errors.iter_rows(named=True)}
    assert by_id["in_prompt"]["line"] == 2 and by_id["in_prompt"]["message"] == (
        "'prompt' holds the lone surrogate \\ud800 (half of a UTF-16 pair), which is not a character; "
        "fix the line's \\u escapes")
    assert by_id["lone_surrogates.jsonl#2"]["message"].startswith("'id' holds the lone surrogate \\udc00")
    assert by_id["in_message"]["message"].startswith("'messages[0].content' holds")
    assert by_id["in_key"]["message"].startswith("the key 'n\\ud800' of the row holds")
    assert by_id["nested"]["message"].startswith("'meta.tags[1]' holds the lone surrogate \\ud834")
    nul = pl.read_parquet(out / "results.parquet").filter(pl.col("id") == "nul")
    assert nul["note"].to_list() == ["a\x00b"]


def test_text_that_is_not_unicode_in_a_dry_run_and_an_embedding_job(run_null, cli, bundled_model, tmp_path):
    result = run_null(HOSTILE / "lone_surrogates.jsonl", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    out = tmp_path / "embed"
    result = cli("embed", HOSTILE / "lone_surrogates.jsonl", "-o", out, "--model", bundled_model,
                 "--backend", "null", "--progress", "none")
    assert result.exit_code == 0, result.output
    assert len(pl.read_parquet(out / "errors.parquet")) == 6


def test_a_parquet_file_with_text_that_is_not_utf8(run_null, tmp_path):
    """Writers that do not check UTF-8 (polars refuses to read such a file) leave bytes Arrow cannot decode."""
    out = tmp_path / "out"
    result = run_null(HOSTILE / "invalid_utf8.parquet", "-o", out)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["ok"]
    errors = pl.read_parquet(out / "errors.parquet")
    assert dict(zip(errors["id"], errors["message"])) == {
        "bad_prompt": "column 'prompt' is not valid UTF-8; save the file's text as UTF-8",
        "invalid_utf8.parquet#2": "column 'id' is not valid UTF-8; save the file's text as UTF-8",
        "bad_column": "column 'note' is not valid UTF-8; save the file's text as UTF-8"}


def test_openai_lines_with_bad_text_keep_their_custom_id(run_null, write_jsonl, tmp_path):
    """An answer keeps its request's key: a request whose content fails is reported under its custom_id;
    one whose custom_id itself is not text has none to report."""
    def line(custom_id: str, content: str) -> str:
        return ('{"custom_id": "%s", "method": "POST", "url": "/v1/chat/completions", '
                '"body": {"messages": [{"role": "user", "content": "%s"}]}}' % (custom_id, content))

    path = write_jsonl([line("a", "hi"), line("b", "\\ud800"), line("c\\udfff", "hi")])
    out = tmp_path / "out"
    result = run_null(path, "-o", out, "--output-format", "jsonl-openai", "--max-tokens", 4)
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]  # results, then errors
    assert [(line["custom_id"], line["error"] and line["error"]["code"]) for line in lines] == [
        ("a", None), ("b", "bad_text"), (None, "missing_id")]


def test_a_byte_order_mark_is_read_in_files_compressed_files_and_stdin(run_null, tmp_path):
    import gzip

    out = tmp_path / "out"
    result = run_null(HOSTILE / "bom.jsonl", "-o", out)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["a", "b"]
    gz = tmp_path / "bom.jsonl.gz"
    gz.write_bytes(gzip.compress((HOSTILE / "bom.jsonl").read_bytes()))
    result = run_null(gz, "-o", tmp_path / "gz")
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(tmp_path / "gz" / "results.parquet")["id"].to_list() == ["a", "b"]


def test_an_input_folder_may_hold_the_output_folder(run_null, tmp_path):
    """The output folder's own files (parts, results, manifest) are no inputs: the same command resumes."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"id": "a", "prompt": "one"}) + "\n")
    (folder / "notes.json").write_text(json.dumps({"id": "n", "prompt": "not an input"}))  # not a documented suffix
    for out in ("out", "out", "another_out"):  # another run's folder in the input folder is no input either
        result = run_null(folder, "-o", folder / out, "--output-format", "jsonl-openai")
        assert result.exit_code == 0, result.output
        assert pl.read_parquet(folder / out / "results.parquet")["id"].to_list() == ["a"]


def test_a_glob_over_the_output_folder_leaves_its_files_out(run_null, tmp_path):
    pl.DataFrame({"id": ["a"], "prompt": ["one"]}).write_parquet(tmp_path / "in.parquet")
    for _ in range(2):
        result = run_null(str(tmp_path / "**" / "*.parquet"), "-o", tmp_path / "out")
        assert result.exit_code == 0, result.output
        assert pl.read_parquet(tmp_path / "out" / "results.parquet")["id"].to_list() == ["a"]



def test_a_file_name_that_is_not_utf8_is_refused_before_the_run(run_null, tmp_path):
    """Results name their source file: Arrow cannot write a name that is not text."""
    import os

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / os.fsdecode(b"caf\xe9.jsonl")).write_text(json.dumps({"id": "a", "prompt": "one"}) + "\n")
    result = run_null(folder, "-o", tmp_path / "out")
    assert result.exit_code == EXIT_INPUT, result.output
    assert "Error: the input's file name is not valid UTF-8: results could not name their source" in result.stderr
    assert "caf\\udce9.jsonl" in result.stderr


def _compress(codec: str, data: bytes) -> bytes:
    if codec == "gz":
        import gzip

        return gzip.compress(data)
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


@pytest.mark.parametrize("codec", ["gz", "zst"])
def test_a_truncated_compressed_input_stops_the_run(codec, run_null, tmp_path):
    """A compressed file cut short (a copy that did not finish) is an error naming it, never half its rows
    read as the whole file: with --on-bad-line skip too."""
    data = b"".join(json.dumps({"id": str(i), "prompt": f"row {i}"}).encode() + b"\n" for i in range(5000))
    whole = _compress(codec, data)
    path = tmp_path / f"in.jsonl.{codec}"
    path.write_bytes(whole[:len(whole) // 2])
    result = run_null(path, "-o", tmp_path / "out", "--on-bad-line", "skip")
    assert result.exit_code == EXIT_INPUT, result.output
    assert result.stderr.startswith("Error: cannot read compressed input: ")
    assert "the file is cut short" in result.stderr and str(path) in result.stderr
    more = b"".join(json.dumps({"id": f"more {i}", "prompt": "x"}).encode() + b"\n" for i in range(3))
    path.write_bytes(whole + _compress(codec, more))  # concatenated streams (`cat a.gz b.gz`) are one input
    result = run_null(path, "-o", tmp_path / "whole")
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(tmp_path / "whole" / "results.parquet").height == 5003


def test_a_json_array_of_objects_is_read_as_rows(run_null, tmp_path):
    """What pandas' to_json(orient="records") writes, on one line or pretty-printed, compressed or not, with a
    byte-order mark or not: each object a row, numbered and located (the line where it starts) as JSONL rows."""
    import zstandard

    rows = [{"id": f"r{i}", "prompt": f"row {i}, with ] and }} and \\\" in it"} for i in range(5)]
    pretty = json.dumps(rows, indent=4).encode()
    files = {"one_line.json": json.dumps(rows).encode(), "pretty.json": pretty, "bom.json": b"\xef\xbb\xbf" + pretty,
             "pretty.json.gz": _compress("gz", pretty), "pretty.json.zst": zstandard.ZstdCompressor().compress(pretty)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        out = tmp_path / f"out-{name}"
        result = run_null(tmp_path / name, "-o", out, "--include-prompt")
        assert result.exit_code == 0, (name, result.output)
        results = pl.read_parquet(out / "results.parquet").sort("row_index")
        assert results["id"].to_list() == [row["id"] for row in rows], name
        assert results["row_index"].to_list() == list(range(5))
    out = tmp_path / "bad"
    result = run_null(HOSTILE / "records.json", "-o", out, "--on-bad-line", "skip")
    assert result.exit_code == 0, result.output
    errors = pl.read_parquet(out / "errors.parquet").sort("row_index")
    assert errors.select("row_index", "line", "message").rows() == [
        (1, 6, "array element is JSON int, expected an object"),
        (3, 11, "array element is not valid JSON: Expecting ',' delimiter at column 14"),
        (4, 12, "array element is JSON list, expected an object")]


def test_a_json_array_resumes_and_a_changed_one_is_refused(run_null, tmp_path):
    """The fingerprint covers the whole array: a rerun resumes; an element added (inside the brackets) is a
    changed input, not rows appended."""
    path = tmp_path / "in.json"
    rows = [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}]
    path.write_text(json.dumps(rows))
    out = tmp_path / "out"
    assert run_null(path, "-o", out).exit_code == 0
    result = run_null(path, "-o", out)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].sort().to_list() == ["a", "b"]
    path.write_text(json.dumps([*rows, {"id": "c", "prompt": "three"}]))
    result = run_null(path, "-o", out)
    assert result.exit_code == EXIT_MISMATCH, result.output
    assert f"input {path.resolve()} changed (not only appended to)" in result.stderr



def test_a_prompt_too_long_by_its_length_alone_is_not_tokenized(run_null, write_jsonl, tmp_path):
    """Tokenizing costs ~225 bytes of memory a byte of text: a line of 200 MB must be refused from its
    length (a token is at most the vocabulary's longest, 81 characters for SmolLM2), as the tokenized
    check words it; a shorter one is counted."""
    path = write_jsonl([{"id": "huge", "prompt": "ab " * 60_000}, {"id": "long", "prompt": "ab " * 3_000},
                        {"id": "ok", "prompt": "hi"}])
    out = tmp_path / "out"
    result = run_null(path, "-o", out)
    assert result.exit_code == 0, result.output
    errors = dict(pl.read_parquet(out / "errors.parquet").select("id", "message").rows())
    assert re.fullmatch(r"prompt has at least 22\d\d tokens \(180\d\d\d characters, not tokenized\) but max_model_len "
                        "is 2048, leaving no room for output; raise --max-model-len or shorten the prompt",
                        errors["huge"]), errors["huge"]  # the prompt: the row's text in the chat template
    assert errors["long"].startswith("prompt has 30") and "max_model_len is 2048" in errors["long"]
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["ok"]


def test_a_dot_dot_after_a_symbolic_link_means_what_the_os_means(run_null, tmp_path, monkeypatch):
    """`link/../x` is x beside the link's target (as open() reads it), not x beside the link: for inputs,
    the output folder and a job file's paths."""
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    (tmp_path / "real" / "in.jsonl").write_text(json.dumps({"id": "target's", "prompt": "one"}) + "\n")
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "link's", "prompt": "one"}) + "\n")
    monkeypatch.chdir(tmp_path)
    result = run_null("link/../in.jsonl", "-o", "link/../out")
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(tmp_path / "real" / "out" / "results.parquet")["id"].to_list() == ["target's"]
    (tmp_path / "real" / "sub" / "job.toml").write_text('inputs = ["../in.jsonl"]\noutput_dir = "../job-out"\n')
    result = run_null("--job", "link/job.toml")
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(tmp_path / "real" / "job-out" / "results.parquet")["id"].to_list() == ["target's"]
    from qbatch.serve.client import absolute_paths

    sent = absolute_paths({"inputs": ["link/../in.jsonl"], "output_dir": "link/../out"}, tmp_path)  # to the service
    assert (sent["inputs"], sent["output_dir"]) == ([str(tmp_path / "real" / "in.jsonl")], str(tmp_path / "real" / "out"))
