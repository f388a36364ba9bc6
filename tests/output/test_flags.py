"""What a user must not miss about an answer (issue #52): the `flag` column, its counts in the summary and
stats.json, `--max-unusable`'s exit, and which rows think (their output split at `</think>`).

On main at 75da4e3 a Qwen3 run whose every row ended inside its reasoning said 5/5 ok, and a raw prompt's
whole output landed in `reasoning` with `text` empty. The null engine's answer has no `</think>`: a
thinking row's output ends inside its reasoning, a raw row's is all text.
"""

from __future__ import annotations

import json

import polars as pl
import pytest

from qbatch.errors import EXIT_UNUSABLE
from qbatch.output.flags import CUT, EMPTY, IN_REASONING, NOT_PARSED, flag_lines, row_flag

ROWS = [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(4)]


def run_qwen3(cli, tiny_qwen3, *args):
    return cli("run", *args, "--model", tiny_qwen3, "--backend", "null", "--progress", "none")


def test_a_flag_names_the_problem_that_matters_most():
    assert row_flag(thinking=True, answer="", reasoning_closed=False, finish_reason="length",
                    parse_error="cut") == IN_REASONING
    assert row_flag(thinking=True, answer="{", reasoning_closed=True, finish_reason="length",
                    parse_error="cut") == NOT_PARSED
    assert row_flag(thinking=None, answer="  ", reasoning_closed=False, finish_reason="stop", parse_error=None) == EMPTY
    assert row_flag(thinking=None, answer="half", reasoning_closed=False, finish_reason="length",
                    parse_error=None) == CUT
    assert row_flag(thinking=False, answer="yes", reasoning_closed=False, finish_reason="stop", parse_error=None) is None
    assert flag_lines({IN_REASONING: 29, CUT: 2}, 40) == [
        "29 of 40 rows ended inside their reasoning (no answer): raise --max-tokens or pass --no-thinking",
        "2 of 40 rows were cut at max_tokens (finish_reason length): raise --max-tokens if the answers must be whole"]


def test_rows_that_ended_inside_their_reasoning_are_flagged_counted_and_can_fail_the_run(
        cli, tiny_qwen3, write_jsonl, tmp_path):
    out = tmp_path / "out"
    result = run_qwen3(cli, tiny_qwen3, write_jsonl(ROWS), "-o", out, "--max-unusable", "0.5")
    assert result.exit_code == EXIT_UNUSABLE, result.output
    df = pl.read_parquet(out / "results.parquet")
    assert df["flag"].to_list() == [IN_REASONING] * 4 and df["text"].to_list() == [""] * 4
    assert df["reasoning"].str.starts_with("[null engine").all()
    assert ("4 of 4 rows ended inside their reasoning (no answer): raise --max-tokens or pass --no-thinking"
            in result.stdout)
    assert "answers to check                4 of 4 rows (4 in_reasoning)" in result.stdout
    assert json.loads((out / "stats.json").read_text())["flags"] == {IN_REASONING: 4}
    again = run_qwen3(cli, tiny_qwen3, write_jsonl(ROWS), "-o", out)  # the rerun resumes, the flags are still counted
    assert again.exit_code == 0 and "4 of 4 rows ended inside their reasoning" in again.stdout
    # status counts them over results.parquet's rows too, not over the last run's (which did none)
    assert "4 of 4 rows ended inside their reasoning" in cli("status", out).output


def test_thinking_off_raw_prompts_and_completions_lines_are_not_split(cli, tiny_qwen3, write_jsonl, tmp_path):
    """Only chat-templated rows with thinking on think: a raw prompt or a /v1/completions line opens no
    reasoning, and vLLM's own /v1/completions returns the output as text."""
    for args, name in (((), "off"), (("--raw",), "raw")):
        out = tmp_path / name
        extra = ("--no-thinking",) if name == "off" else args
        result = run_qwen3(cli, tiny_qwen3, write_jsonl(ROWS), "-o", out, "--max-unusable", "0", *extra)
        assert result.exit_code == 0, result.output  # cut rows still have an answer: not unusable
        df = pl.read_parquet(out / "results.parquet")
        assert df["text"].str.starts_with("[null engine").all() and df["reasoning"].is_null().all()
        assert df["flag"].to_list() == [CUT] * 4
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "2+2=", "max_tokens": 5}},
             {"custom_id": "m", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}}]
    out = tmp_path / "openai"
    assert run_qwen3(cli, tiny_qwen3, write_jsonl(lines), "-o", out).exit_code == 0
    df = pl.read_parquet(out / "results.parquet")
    completion, chat = df.row(0, named=True), df.row(1, named=True)
    assert completion["text"].startswith("[null engine") and completion["reasoning"] is None
    assert chat["text"] == "" and chat["flag"] == IN_REASONING


def test_a_raw_constrained_row_is_never_silently_unconstrained(cli, tiny_qwen3, write_jsonl, tmp_path):
    """Under a reasoning parser a constraint waits for `</think>`; a raw prompt never opens reasoning, so its
    constraint would never apply (issue #52: 0 of 2,048 rows were JSON): the row says so instead. A --raw
    job gets no parser by default (plan/resolve.py), so its constraint holds from the first token."""
    out = tmp_path / "out"
    result = run_qwen3(cli, tiny_qwen3, write_jsonl(ROWS), "-o", out, "--raw", "--choice", "yes,no",
                       "--reasoning-parser", "qwen3")
    assert result.exit_code == 0, result.output
    errors = pl.read_parquet(out / "errors.parquet")
    assert errors["error"].to_list() == ["constraint_not_applied"] * 4
    assert "would hold its constraint until a `</think>` the model never writes" in errors["message"][0]
    out = tmp_path / "closed"
    closed = [{"id": "x", "prompt": "<think>\n\n</think>\n\nAnswer yes or no:"}]
    assert run_qwen3(cli, tiny_qwen3, write_jsonl(closed), "-o", out, "--raw", "--choice", "yes,no",
                     "--reasoning-parser", "qwen3").exit_code == 0
    df = pl.read_parquet(out / "results.parquet")
    assert df["flag"].to_list() == [NOT_PARSED]  # the null engine's answer is no choice: flagged, not hidden


@pytest.mark.parametrize("share", ["1.5", "-0.1"])
def test_max_unusable_is_a_share(cli, tiny_qwen3, write_jsonl, tmp_path, share):
    result = run_qwen3(cli, tiny_qwen3, write_jsonl(ROWS), "-o", tmp_path / "out", "--max-unusable", share)
    assert result.exit_code == 2 and "--max-unusable" in result.output
