"""Carried columns with the null engine: every input column reaches the results by default, the
prompt's and messages' included, so that a result shows its question; --keep-columns / --drop-columns
choose; a carried column named like a result column is kept as input_<name>, never hidden."""

from __future__ import annotations

import json

import polars as pl
import pytest

from qbatch.errors import EXIT_MISMATCH, EXIT_USAGE

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]



def _results(out) -> pl.DataFrame:
    return pl.read_parquet(out / "results.parquet")


def test_the_prompt_and_messages_columns_are_carried_with_their_types(run_null_short, write_jsonl, tmp_path):
    rows = [{"id": "p", "prompt": "Name a cat.", "topic": "pets"},
            {"id": "m", "messages": MESSAGES, "topic": "math"}]
    out = tmp_path / "out"
    result = run_null_short(write_jsonl(rows), "-o", out)
    assert result.exit_code == 0, result.output
    df = _results(out)
    assert df.columns[:6] == ["id", "source", "row_index", "prompt", "topic", "messages"]
    assert df.schema["prompt"] == pl.String
    assert df.schema["messages"] == pl.List(pl.Struct({"role": pl.String, "content": pl.String}))
    assert df["prompt"].to_list() == ["Name a cat.", None] and df["messages"].to_list() == [None, MESSAGES]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["columns"]["messages"] == "list<item: struct<role: string, content: string>>"


def test_a_failing_rows_odd_values_leave_the_other_rows_columns_their_types(run_null_short, write_jsonl, tmp_path):
    """A row that fails (a number for its prompt, a word for its temperature, a string for its messages)
    goes to the errors; its values do not turn every other row's value of the column into JSON text."""
    rows = [{"id": "a", "prompt": "Name a cat.", "temperature": 0.5},
            {"id": "b", "prompt": 42},
            {"id": "c", "prompt": "Name a dog.", "temperature": "hot"},
            {"id": "d", "messages": MESSAGES},
            {"id": "e", "messages": "not a list"}]
    out = tmp_path / "out"
    result = run_null_short(write_jsonl(rows), "-o", out)
    assert result.exit_code == 0, result.output
    df = _results(out)
    assert df["id"].to_list() == ["a", "d"]
    assert (df.schema["prompt"], df.schema["temperature"]) == (pl.String, pl.Float64)
    assert df["prompt"].to_list() == ["Name a cat.", None] and df["temperature"].to_list() == [0.5, None]
    assert df["messages"].to_list() == [None, MESSAGES]
    errors = pl.read_parquet(out / "errors.parquet")
    assert errors.select("id", "error").rows() == [("b", "bad_prompt"), ("c", "bad_param"), ("e", "bad_messages")]


def test_drop_columns_and_keep_columns(run_null_short, write_jsonl, tmp_path):
    path = write_jsonl([{"id": "a", "prompt": "hi", "topic": "x", "big": "y" * 100}])
    assert run_null_short(path, "-o", tmp_path / "drop", "--drop-columns", "prompt,big").exit_code == 0
    assert _results(tmp_path / "drop").columns[:4] == ["id", "source", "row_index", "topic"]
    assert run_null_short(path, "-o", tmp_path / "keep", "--keep-columns", "prompt").exit_code == 0
    assert _results(tmp_path / "keep").columns[:5] == ["id", "source", "row_index", "prompt", "text"]
    result = run_null_short(path, "-o", tmp_path / "both", "--keep-columns", "prompt", "--drop-columns", "big")
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.startswith("Error: --keep-columns names the columns to carry, --drop-columns those to "
                                    "leave out: pass one of them")


def test_drop_columns_is_a_job_file_key_and_changes_the_fingerprint(run_null_short, write_jsonl, tmp_path):
    path = write_jsonl([{"id": "a", "prompt": "hi", "topic": "x"}])
    job = tmp_path / "job.toml"
    job.write_text(f'inputs = ["{path}"]\noutput_dir = "out"\ndrop_columns = ["prompt"]\n')
    result = run_null_short("--job", job)
    assert result.exit_code == 0, result.output
    assert "prompt" not in _results(tmp_path / "out").columns
    result = run_null_short(path, "-o", tmp_path / "out")  # carrying the prompt now would change the results file
    assert result.exit_code == EXIT_MISMATCH and "drop_columns was ['prompt'], now None" in result.stderr


def test_a_folder_written_before_the_prompt_was_carried_is_not_resumed_without_it(run_null_short, write_jsonl, tmp_path):
    path = write_jsonl([{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "yo"}])
    out = tmp_path / "out"
    assert run_null_short(path, "-o", out, "--limit", 1).exit_code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["fingerprint"]["settings"]["carried_columns"]  # as a folder of an earlier qbatch
    (out / "manifest.json").write_text(json.dumps(manifest))
    result = run_null_short(path, "-o", out)  # its first row has no prompt column: the second would have one
    assert result.exit_code == EXIT_MISMATCH and "carried_columns was None" in result.stderr
    assert "Hint: rerun with --restart" in result.stderr
    assert run_null_short(path, "-o", out, "--restart").exit_code == 0
    assert _results(out)["prompt"].to_list() == ["hi", "yo"]


def test_a_column_named_like_a_result_column_is_carried_as_input_name(run_null_short, write_jsonl, tmp_path):
    rows = [{"id": 1, "title": "Cats", "text": "They purr.", "finish_reason": "kept"}]
    out = tmp_path / "template"
    result = run_null_short(write_jsonl(rows), "-o", out, "--template", "Summarize {title}: {text}")
    assert result.exit_code == 0, result.output
    row = _results(out).row(0, named=True)
    assert (row["title"], row["input_text"], row["input_finish_reason"]) == ("Cats", "They purr.", "kept")
    assert row["text"].startswith("[null engine") and row["finish_reason"] == "length"

    path = write_jsonl([{"id": "a", "prompt": "What is 2+2?"}], "p.jsonl")
    out = tmp_path / "rendered"
    assert run_null_short(path, "-o", out, "--include-prompt").exit_code == 0
    row = _results(out).row(0, named=True)
    assert row["input_prompt"] == "What is 2+2?"  # the question as given
    assert row["prompt"].endswith("What is 2+2?<|im_end|>\n<|im_start|>assistant\n")  # as the model saw it


def test_openai_lines_carry_their_input_and_url_not_the_whole_body(run_null_short, write_jsonl, tmp_path):
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": MESSAGES, "max_tokens": 3, "temperature": 0.5}},
             {"custom_id": "t", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once", "max_tokens": 2}}]
    out = tmp_path / "out"
    result = run_null_short(write_jsonl(lines), "-o", out, "--output-format", "jsonl-openai")
    assert result.exit_code == 0, result.output
    df = _results(out)
    assert df.columns[:6] == ["id", "source", "row_index", "messages", "url", "prompt"]
    assert df["messages"].to_list() == [MESSAGES, None] and df["prompt"].to_list() == [None, "Once"]
    assert df["url"].to_list() == ["/v1/chat/completions", "/v1/completions"]
    assert not {"body", "method", "custom_id"} & set(df.columns)
    chat, text = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert (chat["response"]["body"]["object"], text["response"]["body"]["object"]) == ("chat.completion",
                                                                                          "text_completion")
    out = tmp_path / "dropped"
    assert run_null_short(write_jsonl(lines), "-o", out, "--drop-columns", "messages,prompt").exit_code == 0
    assert _results(out).columns[:4] == ["id", "source", "row_index", "url"]  # url names the response's object


def test_embeddings_carry_their_text(cli, bundled_model, write_jsonl, tmp_path):
    rows = [{"id": "d", "prompt": "a document"},
            {"custom_id": "o", "method": "POST", "url": "/v1/embeddings", "body": {"input": "an OpenAI line"}}]
    out = tmp_path / "out"
    result = cli("embed", write_jsonl(rows), "-o", out, "--model", bundled_model, "--backend", "null",
                 "--progress", "none")
    assert result.exit_code == 0, result.output
    df = _results(out)
    assert df["prompt"].to_list() == ["a document", None] and df["input"].to_list() == [None, "an OpenAI line"]


@pytest.mark.parametrize(("appended", "kind", "scores"), [
    ([2.5, None], pl.Float64, [1.0, 2.0, 2.5, None]),
    (["high", None], pl.String, ["1", "2", '"high"', None]),
], ids=["a float", "text"])
def test_the_cron_rerun_widens_an_int_column_that_appended_rows_changed(run_null_short, write_jsonl, tmp_path,
                                                                        appended, kind, scores):
    """Rows appended to the input whose `score` is a float (or text) where it was an int: the rerun resumes,
    the parts written before take the widened type, and the results hold every row once."""
    rows = [{"id": "a", "prompt": "one", "score": 1}, {"id": "b", "prompt": "two", "score": 2}]
    path, out = write_jsonl(rows), tmp_path / "out"
    assert run_null_short(path, "-o", out).exit_code == 0
    with open(path, "a") as handle:
        for i, score in enumerate(appended):
            handle.write(json.dumps({"id": f"n{i}", "prompt": "new", "score": score}) + "\n")
    result = run_null_short(path, "-o", out)
    assert result.exit_code == 0, result.output
    assert "rows ok (this run)              2" in result.stdout
    results = pl.read_parquet(out / "results.parquet")
    assert results["id"].to_list() == ["a", "b", "n0", "n1"]
    assert results.schema["score"] == kind and results["score"].to_list() == scores
    assert {pl.read_parquet(part).schema["score"] for part in (out / "parts").glob("part-*.parquet")} == {kind}
    assert run_null_short(path, "-o", out).exit_code == 0  # the next rerun: nothing to widen again
    assert pl.read_parquet(out / "results.parquet")["score"].to_list() == scores


def test_a_part_widened_to_json_text_before_a_kill_is_not_encoded_again(tmp_path):
    """A run killed while it widened leaves some parts widened under the old record: its rerun widens the rest only."""
    import pyarrow as pa

    from qbatch.output.columns import JSON_TEXT
    from qbatch.output.folder import RESULT_PREFIX, OutputDir
    from qbatch.output.widening import widen_parts

    out = OutputDir(tmp_path / "out").open()
    try:
        out.write_part(RESULT_PREFIX, pa.table({"id": ["a"], "score": ["x"]}))
        for _ in range(2):  # the killed run, then its rerun
            widen_parts(out, {"score": pa.string()}, {"score": JSON_TEXT}, own=set())
        assert pl.read_parquet(out.part_files(RESULT_PREFIX)[0])["score"].to_list() == ['"x"']
    finally:
        out.close()
