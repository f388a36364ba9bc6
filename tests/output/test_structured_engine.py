"""Structured output, n samples and logprobs through the real vLLM engine (CPU, tiny random Qwen3).

Every test runs with a job-level constraint, so they share one engine (reasoning_parser qwen3).
"""

from __future__ import annotations

import json
import re

import polars as pl
import pytest

pytestmark = pytest.mark.slow

LABELS = ["billing", "bug", "feature", "praise", "other"]
SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "enum": LABELS},
                                           "urgent": {"type": "boolean"}},
          "required": ["label", "urgent"], "additionalProperties": False}


@pytest.fixture
def run_tiny(cli, tiny_qwen3, write_jsonl, tmp_path):
    path = write_jsonl([{"id": f"t{i}", "prompt": f"ticket {i}: the app crashed"} for i in range(6)])

    def run(name, *args, inputs=None):
        out = tmp_path / name
        result = cli("run", inputs or path, "-o", out, "--model", tiny_qwen3, "--progress", "none",
                     "--max-model-len", "512", "--seed", "1", *args)
        assert result.exit_code == 0, result.output
        return out, pl.read_parquet(out / "results.parquet")

    return run


def test_choice_logprobs_and_n(run_tiny):
    out, df = run_tiny("choice", "--choice", ",".join(LABELS), "--no-thinking", "--max-tokens", "16",
                       "--n", "3", "--logprobs", "--top-logprobs", "5", "--temperature", "1.0")
    assert df.height == 18 and set(df["text"]) <= set(LABELS)
    assert df["parsed"].to_list() == df["text"].to_list()
    assert df.group_by("id").agg(pl.col("sample_index").sort())["sample_index"].to_list() == [[0, 1, 2]] * 6
    first = df["logprobs"][0][0]
    assert set(first) == {"token", "logprob", "top_logprobs"} and len(first["top_logprobs"]) == 5
    scores = df["choice_logprobs"].to_list()
    assert any(s is not None for s in scores)
    assert all(set(s) == set(LABELS) for s in scores if s is not None)


def test_json_schema_with_a_real_model(cli, bundled_model, write_jsonl, tmp_path):
    import jsonschema

    # A random model wanders in JSON's free whitespace until max_tokens; SmolLM2 writes the object.
    path = write_jsonl([{"id": f"t{i}", "prompt": f"Classify ticket {i}: the app crashed. Answer in JSON."}
                        for i in range(4)])
    result = cli("run", path, "-o", tmp_path / "schema", "--model", bundled_model, "--progress", "none",
                 "--max-model-len", "512", "--json-schema", json.dumps(SCHEMA), "--max-tokens", "64",
                 "--temperature", "0")
    assert result.exit_code == 0, result.output
    df = pl.read_parquet(tmp_path / "schema" / "results.parquet")
    parsed = [json.loads(p) for p in df["parsed"] if p is not None]
    assert parsed, df["parse_error"].to_list()
    for value in parsed:
        jsonschema.validate(value, SCHEMA)
    assert all(e is None or "max_tokens" in e for e in df["parse_error"])


def test_regex_and_thinking(run_tiny):
    import jsonschema

    _, df = run_tiny("regex", "--regex", r"[A-Z]{2}-\d{3}", "--no-thinking", "--max-tokens", "16")
    assert all(re.fullmatch(r"[A-Z]{2}-\d{3}", t) for t in df["text"])

    # Thinking on: the constraint waits for </think>, so the reasoning is free text (a random model
    # rarely closes it: its text stays empty, parse_error says it was cut).
    _, df = run_tiny("thinking", "--json-schema", json.dumps(SCHEMA), "--thinking", "--max-tokens", "24")
    assert all(r and not r.lstrip().startswith("{") for r in df["reasoning"])
    assert all(p is None or jsonschema.validate(json.loads(p), SCHEMA) is None for p in df["parsed"])


def test_openai_response_format_parses_with_the_sdk(run_tiny, write_jsonl):
    from openai.types.chat import ChatCompletion

    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "classify"}], "max_tokens": 48, "n": 2,
                       "logprobs": True, "top_logprobs": 2, "chat_template_kwargs": {"enable_thinking": False},
                       "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}}
             for i in range(3)]
    # The job's --choice is replaced by each line's response_format (and keeps the shared engine).
    out, df = run_tiny("openai", "--choice", "x,y", "--output-format", "jsonl-openai", inputs=write_jsonl(lines, "b.jsonl"))
    assert df.height == 6
    for line in (out / "results.jsonl").read_text().splitlines():
        body = ChatCompletion.model_validate(json.loads(line)["response"]["body"])
        assert len(body.choices) == 2 and body.choices[0].logprobs.content
