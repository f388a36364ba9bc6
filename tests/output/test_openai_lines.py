"""OpenAI Batch output lines survive the ways clients split a downloaded file."""

from __future__ import annotations

import json

import polars as pl

from qbatch.output.assemble import write_openai_jsonl


def test_a_text_with_unicode_line_separators_stays_one_line(tmp_path):
    """str.splitlines() breaks at U+2028, U+0085, U+001C...; a model's text may hold them (seen in CI)."""
    text = "a\u2028b\x85c\x1cd\u2029e é"
    pl.DataFrame({"id": ["r1"], "source": ["in.jsonl"], "row_index": [0], "text": [text], "reasoning": [None],
                  "finish_reason": ["stop"], "prompt_tokens": [3], "completion_tokens": [5],
                  "cached_tokens": [0]}).write_parquet(tmp_path / "results.parquet")
    pl.DataFrame({"id": [], "source": [], "row_index": [], "line": [], "error": [], "message": []},
                 schema={"id": pl.String, "source": pl.String, "row_index": pl.Int64, "line": pl.Int64,
                         "error": pl.String, "message": pl.String}).write_parquet(tmp_path / "errors.parquet")
    write_openai_jsonl(tmp_path, "m")
    lines = (tmp_path / "results.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["response"]["body"]["choices"][0]["message"]["content"] == text
