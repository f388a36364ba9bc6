"""Structured output, n samples and logprobs without a model: validation before loading, error
rows, exactly-once with n > 1 across a resume, and the parsing and scoring rules."""

from __future__ import annotations

import json

import polars as pl
import pytest

from qbatch.errors import EXIT_USAGE
from qbatch.output.samples import CUT, choice_logprobs, parse
from qbatch.records import Completion, Request



@pytest.mark.parametrize(("flags", "message"), [
    (["--json-schema", '{"type": "objekt"}'], "Error: invalid JSON schema at type: 'objekt' is not valid"),
    (["--json-schema", "{not json"], "Error: JSON schema is not valid JSON"),
    (["--json-schema", "missing.json"], "Error: the json schema file does not exist (missing.json)"),
    (["--grammar", "grammars/answer.gbnf"], "Error: the grammar file does not exist (grammars/answer.gbnf)"),
    (["--regex", "[a-"], "Error: invalid regex '[a-'"),
    (["--choice", "a,a"], "Error: choice lists a value twice"),
    (["--regex", "a", "--choice", "a,b"], "Error: --choice and --regex are two constraints; a job takes one"),
    (["--top-logprobs", "21"], "Error: top_logprobs must be in [0, 20]"),
    (["--n", "0"], "Error: n must be >= 1"),
])
def test_bad_job_constraint_exits_2_before_the_model_loads(run_null, write_jsonl, tmp_path, flags, message):
    result = run_null(write_jsonl([{"id": "a", "prompt": "x"}]), "-o", tmp_path / "out", *flags)
    assert result.exit_code == EXIT_USAGE, result.output
    assert message in result.output


def test_json_schema_from_a_file_enters_the_fingerprint(run_null, write_jsonl, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}))
    path, out = write_jsonl([{"id": "a", "prompt": "x"}]), tmp_path / "out"
    assert run_null(path, "-o", out, "--json-schema", schema).exit_code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["fingerprint"]["settings"]["structured_outputs"] == {"json": json.loads(schema.read_text())}
    schema.write_text(json.dumps({"type": "object"}))  # same file name, other content: a changed setting
    assert run_null(path, "-o", out, "--json-schema", schema).exit_code == 5


def test_bad_row_constraints_are_error_rows(run_null, write_jsonl, tmp_path):
    rows = [{"id": "ok", "prompt": "x", "guided_choice": ["a", "b"]},
            {"id": "schema", "prompt": "x", "structured_outputs": {"json": {"type": 3}}},
            {"id": "regex", "prompt": "x", "guided_regex": "("},
            {"id": "two", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
            {"id": "logprobs", "prompt": "x", "top_logprobs": 50}]
    out = tmp_path / "out"
    assert run_null(write_jsonl(rows), "-o", out).exit_code == 0
    errors = pl.read_parquet(out / "errors.parquet")
    assert dict(zip(errors["id"], errors["error"])) == {"schema": "bad_constraint", "regex": "bad_constraint",
                                                         "two": "bad_constraint", "logprobs": "bad_param"}
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["ok"]


def test_n_samples_are_result_rows_and_resume_keeps_exactly_once(run_null, write_jsonl, tmp_path):
    rows = [{"id": f"r{i}", "prompt": "word " * (i % 5 + 1)} for i in range(30)]
    path, out = write_jsonl(rows), tmp_path / "out"
    assert run_null(path, "-o", out, "--n", "3", "--limit", "11", "--chunk-tokens", "300").exit_code == 0
    assert run_null(path, "-o", out, "--n", "3", "--chunk-tokens", "300").exit_code == 0
    df = pl.read_parquet(out / "results.parquet")
    assert df.height == 90
    assert df.group_by("id").agg(pl.col("sample_index").sort()).filter(
        pl.col("sample_index") != [0, 1, 2]).height == 0
    assert df["id"].unique(maintain_order=True).to_list() == [f"r{i}" for i in range(30)]
    assert run_null(path, "-o", out, "--n", "2").exit_code == 5  # n changes results: refused


def test_openai_lines_group_samples_into_choices(run_null, write_jsonl, tmp_path):
    from openai.types.chat import ChatCompletion

    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}], "n": 2}}
    out = tmp_path / "out"
    assert run_null(write_jsonl([line]), "-o", out, "--output-format", "jsonl-openai").exit_code == 0
    (response,) = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    body = ChatCompletion.model_validate(response["response"]["body"])
    assert [c.index for c in body.choices] == [0, 1]


def test_parse_rules():
    schema = {"json": {"type": "object"}}
    assert parse(schema, '{"a": 1}', "stop") == ('{"a":1}', None)
    assert parse(schema, '{"a": ', "length") == (None, CUT)
    assert parse(schema, "", "length") == (None, CUT)
    assert parse({"choice": ["yes", "no"]}, "no", "stop") == ("no", None)
    assert parse({"regex": r"\d{3}"}, "12a", "stop") == (None, "does not match the regex")


def _completion(tokens, thinking=None):
    request = Request("a", 0, 0, [1], {"max_tokens": 4}, thinking)
    return Completion(request, "", "stop", len(tokens), logprobs=tokens)


def test_choice_logprobs_from_the_answers_first_token():
    first = {"token": "pos", "logprob": -0.1,
             "top_logprobs": [{"token": "pos", "logprob": -0.1}, {"token": "neg", "logprob": -2.4}]}
    scores = choice_logprobs(["positive", "negative", "neutral"], _completion([first]))
    assert scores["positive"] == pytest.approx(-0.1) and scores["negative"] == pytest.approx(-2.4)
    assert scores["neutral"] == float("-inf")
    thought = [{"token": "hmm", "logprob": -1.0, "top_logprobs": []},
               {"token": "</think>", "logprob": -1.0, "top_logprobs": []}, first]
    assert choice_logprobs(["positive", "negative"], _completion(thought, thinking=True))["positive"] == \
        pytest.approx(-0.1)
    shared = {"token": "ne", "logprob": -0.5, "top_logprobs": [{"token": "ne", "logprob": -0.5}]}
    assert choice_logprobs(["negative", "neutral"], _completion([shared])) is None  # the first token does not decide


def test_each_distinct_schema_is_checked_once(monkeypatch):
    """Rows sharing a schema do not each pay the meta-schema check (milliseconds of GIL-held Python
    a row slowed JSON jobs against vLLM alone); a bad schema stays a bad row every time."""
    import jsonschema

    from qbatch.errors import RowError
    from qbatch.sampling import _schema_error, check_structured

    checked = []
    real = jsonschema.validators.validator_for

    def counting(schema, *args, **kwargs):
        checked.append(schema)  # also the meta-schema's parts it looks up on its way
        return real(schema, *args, **kwargs)

    _schema_error.cache_clear()
    monkeypatch.setattr(jsonschema.validators, "validator_for", counting)
    schema = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}, "n": {"type": "integer"}}}
    for i in range(50):  # each row its own parsed copy, keys in any order
        row_schema = json.loads(json.dumps(schema, sort_keys=bool(i % 2)))
        assert check_structured({"json": row_schema}) == {"json": row_schema}
    assert checked.count(schema) == 1
    for _ in range(3):
        with pytest.raises(RowError, match="invalid JSON schema at type"):
            check_structured({"json": {"type": "objekt"}})
    assert checked.count({"type": "objekt"}) == 1
    with pytest.raises(RowError, match="not JSON"):
        check_structured({"json": {"type": object}})  # a Python value in a schema built in Python
