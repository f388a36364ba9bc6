"""Which column keys a row and which shape a row has, on real data: OpenAI batch lines that carry
other keys, DataFrames of mixed rows (nulls in the other shape's columns), OpenAI's token-id inputs."""

from __future__ import annotations

import json

import polars as pl
import pytest



@pytest.fixture
def embed_null(cli, bundled_model):
    def embed(*args):
        return cli("embed", *args, "--model", bundled_model, "--backend", "null", "--progress", "none")

    return embed


def batch_line(custom_id: str | None, url: str, body: dict, **other) -> dict:
    line = {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **other}
    return {k: v for k, v in line.items() if v is not None}


def openai_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"


def test_openai_lines_are_keyed_by_custom_id_whatever_other_keys_they_carry(run_null_short, write_jsonl, tmp_path):
    """Some tools write a top-level `id` beside custom_id (the same value on every line here): OpenAI
    ignores it, and so does qbatch; an answer comes back under its request's custom_id."""
    path = write_jsonl([
        batch_line("a", CHAT, {"messages": [{"role": "user", "content": "hi"}]}, id="x"),
        batch_line("b", COMPLETIONS, {"prompt": "Once upon"}, id="x"),
        batch_line(None, CHAT, {"messages": [{"role": "user", "content": "hi"}]}, id="y"),  # no custom_id
    ])
    out = tmp_path / "out"
    result = run_null_short(path, "-o", out, "--output-format", "jsonl-openai")
    assert result.exit_code == 0, result.output
    lines = openai_lines(out / "results.jsonl")  # results, then errors
    assert [(line["custom_id"], line["error"] and line["error"]["code"]) for line in lines] == [
        ("a", None), ("b", None), (None, "missing_id")]
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["a", "b"]


def test_embedding_lines_are_keyed_by_custom_id(embed_null, write_jsonl, tmp_path):
    path = write_jsonl([batch_line("a", EMBEDDINGS, {"input": "one"}, id=7),
                        batch_line("b", EMBEDDINGS, {"input": "two"}, id=7)])
    out = tmp_path / "out"
    result = embed_null(path, "-o", out, "--output-format", "jsonl-openai")
    assert result.exit_code == 0, result.output
    assert [line["custom_id"] for line in openai_lines(out / "results.jsonl")] == ["a", "b"]


def test_id_column_names_the_key_of_rows_that_are_not_batch_lines(run_null_short, write_jsonl, tmp_path):
    path = write_jsonl([{"key": "k1", "id": "same", "prompt": "one"}, {"key": "k2", "id": "same", "prompt": "two"}])
    out = tmp_path / "out"
    assert run_null_short(path, "-o", out, "--id-column", "key").exit_code == 0
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["k1", "k2"]


def test_mixed_rows_of_a_dataframe_run_as_they_do_from_jsonl(run_null_short, tmp_path):
    """A DataFrame of prompt rows, chat rows and batch lines holds a null in every column a row lacks:
    a null counts as absent when a row's shape is decided."""
    frame = pl.DataFrame({
        "id": ["p", "m", None],
        "prompt": ["hello", None, None],
        "messages": [None, [{"role": "user", "content": "hi"}], None],
        "custom_id": [None, None, "o"],
        "url": [None, None, COMPLETIONS],
        "body": [None, None, {"prompt": "Once upon"}],
    })
    path = tmp_path / "mixed.parquet"
    frame.write_parquet(path)
    out = tmp_path / "out"
    result = run_null_short(path, "-o", out)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["p", "m", "o"]
    assert not (out / "errors.parquet").exists() or pl.read_parquet(out / "errors.parquet").is_empty()


def test_token_id_inputs_are_one_input_and_arrays_of_several_are_refused(embed_null, bundled_model, write_jsonl,
                                                                         tmp_path):
    """OpenAI's `input` is a string, an array of strings, an array of token ids or an array of token
    arrays; qbatch embeds one input a line: a token list (or an array holding one input) is that input."""
    from qbatch.tokens import load_tokenizer

    vocab = len(load_tokenizer(bundled_model))
    path = write_jsonl([
        batch_line("tokens", EMBEDDINGS, {"input": [1, 2, 3]}),
        batch_line("one_token_array", EMBEDDINGS, {"input": [[4, 5]]}),
        batch_line("strings", EMBEDDINGS, {"input": ["one", "two"]}),
        batch_line("token_arrays", EMBEDDINGS, {"input": [[1], [2]]}),
        batch_line("out_of_range", EMBEDDINGS, {"input": [1, vocab]}),
        batch_line("mixed", EMBEDDINGS, {"input": [1, "two"]}),
    ])
    out = tmp_path / "out"
    result = embed_null(path, "-o", out)
    assert result.exit_code == 0, result.output
    ok = pl.read_parquet(out / "results.parquet")
    assert dict(zip(ok["id"], ok["prompt_tokens"])) == {"tokens": 3, "one_token_array": 2}
    errors = pl.read_parquet(out / "errors.parquet")
    messages = dict(zip(errors["id"], errors["message"]))
    assert messages == {
        "strings": "body.input holds 2 inputs; qbatch takes one input a line (one custom_id a result): "
                   "split them into lines of their own",
        "token_arrays": "body.input holds 2 inputs; qbatch takes one input a line (one custom_id a result): "
                        "split them into lines of their own",
        "out_of_range": f"body.input[1] is {vocab}, not a token id of the model (0 to {vocab - 1})",
        "mixed": "body.input must be a string, a list of token ids, or a list holding one of them",
    }


def test_a_completions_prompt_may_be_token_ids(run_null_short, write_jsonl, tmp_path):
    path = write_jsonl([batch_line("t", COMPLETIONS, {"prompt": [10, 11, 12, 13]}),
                        batch_line("two", COMPLETIONS, {"prompt": ["a", "b"]})])
    out = tmp_path / "out"
    result = run_null_short(path, "-o", out)
    assert result.exit_code == 0, result.output
    ok = pl.read_parquet(out / "results.parquet")
    assert ok.select("id", "prompt_tokens").rows() == [("t", 4)]
    assert pl.read_parquet(out / "errors.parquet")["error"].to_list() == ["bad_body"]


def test_a_text_the_tokenizer_cannot_take_fails_its_row_alone(bundled_model, write_jsonl):
    """Whatever reaches the tokenizer and fails there (one text fails a whole batch call) fails its row only."""
    from qbatch.jobs.job import Job
    from qbatch.spec import JobSpec

    path = write_jsonl([{"id": rid, "prompt": "hello"} for rid in "abc"])
    job = Job.setup(JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model}))
    drafts, _ = job.preparer.render(list(job.identified_rows(set())))
    drafts[1].text = "bad \ud800"
    requests, failures = job.preparer.requests(drafts, job.preparer.encode(drafts))
    assert [r.id for r in requests] == ["a", "c"]
    assert [(f.id, f.error) for f in failures] == [("b", "bad_text")]
    assert failures[0].message.startswith("the tokenizer cannot encode the prompt: ")


@pytest.mark.parametrize("rows", [
    [{"prompt": "no id"}, {"id": "0", "prompt": "a real row whose id is a position"}],
    [{"id": "in.jsonl#1", "prompt": "a real row"}, "{not json"],
    [{"id": 7, "prompt": "a"}, {"id": None, "prompt": "null id"}, {"id": "in.jsonl#1", "prompt": "b"}],
])
def test_a_stand_in_id_that_is_another_rows_id_stops_the_run(rows, run_null_short, write_jsonl, tmp_path):
    """A row without a usable id is named by its position; when that name is another row's real id, --dedupe
    must not drop either row (they are two rows, not one row twice): the run stops before the model loads."""
    path = write_jsonl(rows)
    for flags in ([], ["--dedupe"]):
        result = run_null_short(path, "-o", tmp_path / "out", "--on-bad-line", "skip", *flags)
        assert result.exit_code == 3, result.output
        assert "Error: 1 row without a usable id is named by its position, which is also another row's id: " \
               in result.stderr, result.stderr
        assert "Hint: give every row its own id" in result.stderr
