"""Structured output, n samples and logprobs through the real vLLM engine (CPU, tiny random Qwen3).

Every test runs with a job-level constraint, so they share one engine (reasoning_parser qwen3), but
the thinking-budget test (a template that opens the reasoning in the prompt, the xgrammar backend). A
random model is enough for JSON too: qbatch's default backend leaves it no free whitespace to wander in.
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
    for tokens, num_tokens in zip(df["logprobs"].to_list(), df["completion_tokens"].to_list(), strict=True):
        assert len(tokens) == num_tokens  # one entry a generated token, each sample its own
        assert all(isinstance(t["logprob"], float) and len(t["top_logprobs"]) == 5 for t in tokens)
    scores = df["choice_logprobs"].to_list()
    assert any(s is not None for s in scores)
    assert all(set(s) == set(LABELS) for s in scores if s is not None)


def test_json_schema_at_the_defaults_ends_in_valid_objects(run_tiny):
    """No backend flag: qbatch's default (guidance, compact JSON) leaves a random model no free whitespace
    to wander in, so every row ends in an object of the schema well before max_tokens."""
    import jsonschema

    _, df = run_tiny("schema", "--json-schema", json.dumps(SCHEMA), "--no-thinking", "--max-tokens", "64")
    assert set(df["finish_reason"]) == {"stop"} and df["parse_error"].to_list() == [None] * 6
    for text, parsed in df.select("text", "parsed").iter_rows():
        jsonschema.validate(json.loads(parsed), SCHEMA)
        assert text == parsed == json.dumps(json.loads(text), separators=(",", ":"))  # compact: no free whitespace


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


def test_a_job_seed_repeats_on_a_rerun_and_differs_between_samples_and_rows(run_tiny, write_jsonl):
    # Four rows with one prompt: under one seed for every row they would all get the same samples.
    path = write_jsonl([{"id": f"s{i}", "prompt": "say something"} for i in range(4)], "same.jsonl")
    args = ("--regex", "[a-z]{1,8}( [a-z]{1,8}){0,5}", "--no-thinking", "--max-tokens", "24", "--n", "3",
            "--temperature", "1.0", "--top-p", "1.0", "--top-k", "0")
    _, first = run_tiny("seeded-1", *args, inputs=path)
    _, again = run_tiny("seeded-2", *args, inputs=path)
    assert first.height == 12
    assert again["text"].to_list() == first["text"].to_list()  # reproducible
    _, replanned = run_tiny("seeded-3", *args, "--chunk-tokens", "60", "--order", "input", inputs=path)
    # Another plan (a row a chunk, input order): each row's seed, not the batch, decides its samples.
    # Holds here on the CPU; other batch shapes could change a float sum on other hardware.
    assert replanned["text"].to_list() == first["text"].to_list()
    samples = first.group_by("id", maintain_order=True).agg("text")["text"].to_list()
    assert all(len(set(texts)) > 1 for texts in samples), samples  # a row's samples are not all the same
    assert len({tuple(texts) for texts in samples}) == 4, samples  # rows with the same prompt differ


@pytest.fixture(scope="module")
def tiny_qwen3_thinking(tiny_qwen3, tmp_path_factory):
    """The tiny Qwen3 with a template that opens the reasoning in the prompt (`<think>` after the
    assistant tag, as Qwen3-*-Thinking-2507's template does): vLLM's thinking budget counts from `<think>`,
    which the random model never writes itself (real Qwen3 models do, as their first token)."""
    import shutil

    folder = tmp_path_factory.mktemp("tiny-qwen3-thinking") / "model"
    shutil.copytree(tiny_qwen3, folder)
    template = (folder / "chat_template.jinja").read_text()
    opened = template.replace("{%- endif %}{%- endif %}", "{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}")
    assert opened != template
    (folder / "chat_template.jinja").write_text(opened)
    return str(folder)


def test_thinking_then_a_schema_the_budget_ends_the_reasoning(cli, tiny_qwen3_thinking, write_jsonl, tmp_path):
    """A random model never closes its reasoning by itself: vLLM's thinking_token_budget forces
    `</think>` after 8 reasoning tokens, then the schema (after the reasoning: reasoning parser qwen3)
    holds the answer; without free whitespace (xgrammar's disable_any_whitespace) it ends soon."""
    import jsonschema

    path = write_jsonl([{"id": f"t{i}", "prompt": f"ticket {i}: the app crashed"} for i in range(6)])
    out = tmp_path / "budget"
    result = cli("run", path, "-o", out, "--model", tiny_qwen3_thinking, "--progress", "none", "--max-model-len", "512",
                 "--seed", "1", "--json-schema", json.dumps(SCHEMA), "--thinking", "--thinking-token-budget", "8",
                 "--structured-outputs-backend", "xgrammar", "--disable-any-whitespace", "--max-tokens", "64",
                 "--temperature", "1.0", "--include-prompt")
    assert result.exit_code == 0, result.output
    df = pl.read_parquet(out / "results.parquet")
    assert df["prompt"][0].endswith("<|im_start|>assistant\n<think>\n")
    assert set(df["finish_reason"]) == {"stop"}  # the grammar ended the answer, not max_tokens
    assert df["parse_error"].to_list() == [None] * 6, df.select("reasoning", "text", "parse_error").to_dicts()
    for reasoning, text, parsed in df.select("reasoning", "text", "parsed").iter_rows():
        assert reasoning and "{" not in reasoning  # free text, no JSON: the grammar started after </think>
        jsonschema.validate(json.loads(parsed), SCHEMA)
        assert json.loads(text) == json.loads(parsed)
