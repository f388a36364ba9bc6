"""qbatch report: flagged answers with their counts, fixes and examples (from the flag column, or derived in an
older folder), a small job's page well under 1.5 MB, and no throughput spike when a short job's rows all finish
at once; the flagged examples in a real headless Chromium, screenshot and all."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import polars as pl
import pytest

from qbatch.output.telemetry import write_part
from qbatch.report.data import RATE_WINDOW_S, collect
from qbatch.report.page import render, write_report
from tests.report.test_report import CHROMIUM, START, _chromium, _manifest, _stamp

# rows of each flag: 2 usable, 2 cut, 1 empty, 1 not parsed, 3 inside their reasoning
ROWS = [("ok-1", None, "stop", "Paris.", None, None), ("ok-2", None, "stop", "Rome.", None, None),
        ("cut-1", "cut", "length", "The answer is a long", None, None), ("cut-2", "cut", "length", "One, two", None, None),
        ("empty-1", "empty", "stop", "", None, None),
        ("json-1", "not_parsed", "stop", '{"name": ', None, "expected a value at line 1"),
        *((f"think-{i}", "in_reasoning", "length", "", "Let me count the letters one by one " * 20 + f"END{i}", None)
          for i in range(3))]


def _results(folder: Path, *, with_flag: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    frame = pl.DataFrame({"id": [r[0] for r in ROWS], "flag": [r[1] for r in ROWS],
                          "finish_reason": [r[2] for r in ROWS], "text": [r[3] for r in ROWS],
                          "reasoning": [r[4] for r in ROWS], "parse_error": [r[5] for r in ROWS],
                          "prompt_tokens": [10] * len(ROWS), "completion_tokens": [64] * len(ROWS)},
                         schema_overrides={"flag": pl.String, "reasoning": pl.String, "parse_error": pl.String})
    (frame if with_flag else frame.drop("flag")).write_parquet(folder / "results.parquet")
    _manifest(folder, [], spec={"model": "m", "task": "generate", "max_tokens": 64})
    return folder


@pytest.mark.parametrize("with_flag", [True, False], ids=["flag column", "older folder: derived"])
def test_the_report_counts_each_flag_with_its_fix_and_shows_examples(tmp_path, with_flag):
    info = collect(_results(tmp_path, with_flag=with_flag))
    assert info["answers"]["flags"] == {"cut": 2, "empty": 1, "not_parsed": 1, "in_reasoning": 3}
    assert info["answers"]["derived"] is not with_flag
    page = render(info)
    lines = re.findall(r'<li class="flag-line[^"]*" data-flag="(\w+)">([^<]*)</li>', page)
    assert lines == [
        ("in_reasoning", "3 of 9 rows ended inside their reasoning (no answer): raise --max-tokens or pass --no-thinking"),
        ("not_parsed", "1 of 9 rows did not parse under their constraint: see parse_error; raise --max-tokens if "
                       "they were cut"),
        ("empty", "1 of 9 rows gave an empty answer: check the prompt and the chat template (--raw, --template)"),
        ("cut", "2 of 9 rows were cut at max_tokens (finish_reason length): raise --max-tokens if the answers must "
                "be whole")]
    tables = dict(re.findall(r'data-examples="(\w+)">(.*?)</table>', page))
    assert list(tables) == ["first", "in_reasoning", "not_parsed", "empty", "cut"]
    assert re.findall(r"<code>([\w-]+)</code>", tables["first"]) == ["ok-1", "ok-2", "cut-1"]
    assert re.findall(r"<code>([\w-]+)</code>", tables["in_reasoning"]) == ["think-0", "think-1", "think-2"]
    assert "reasoning, cut: … " in tables["in_reasoning"] and "END2" in tables["in_reasoning"]  # its end: where it was cut
    assert "parse_error: expected a value at line 1" in tables["not_parsed"]
    assert "(no answer)" in tables["empty"] and "The answer is a long" in tables["cut"]
    assert ("flags derived from finish_reason" in page) is not with_flag


def test_a_run_with_every_answer_usable_says_so(tmp_path):
    folder = _results(tmp_path)
    pl.read_parquet(folder / "results.parquet").head(2).write_parquet(folder / "results.parquet")
    page = render(collect(folder))
    assert '<p data-flag="none">All 2 answers usable' in page and 'data-examples="first"' in page


def test_a_small_jobs_page_is_well_under_one_and_a_half_megabytes(null_run):
    """The full plotly.min.js made every page 4.8 MB; the basic bundle (scatter and bar) is 1.2 MB."""
    page = write_report(null_run).read_text()
    assert len(page.encode()) < 1_300_000, len(page.encode())
    assert page.count("Copyright 2012-") == 1  # one copy of Plotly's script


def test_a_short_run_whose_rows_finish_together_draws_no_spike(tmp_path):
    """A 20 s run whose 16 rows (720 tokens) all finish in its last second: the engines count tokens as rows
    finish, so a one-second rate drew 720 tok/s against the run's 36; over the trailing window it stays
    within the window's share of the tokens, and the mean of the line is the run's rate."""
    rows = []
    for s in range(21):
        done = 16 if s == 20 else 0
        rows.append({"time": START + timedelta(seconds=s), "source": "engine", "device": "engine 0",
                     "requests_in_engine": 16 - done, "finished_requests": done, "prompt_tokens": done * 80,
                     "cached_tokens": 0, "generation_tokens": done * 45})
    write_part(tmp_path, rows)
    _manifest(tmp_path, [{"started_at": _stamp(START), "finished_at": _stamp(START + timedelta(seconds=20))}])
    rates = [r for r in collect(tmp_path)["throughput"]["output_tok_s"] if r is not None]
    assert max(rates) == 720 / RATE_WINDOW_S  # was 720.0: the whole output over one second
    short = tmp_path / "short"
    short.mkdir()
    write_part(short, [{**row, "time": START + timedelta(seconds=s)} for s, row in enumerate(rows[16:])])
    _manifest(short, [{"started_at": _stamp(START), "finished_at": _stamp(START + timedelta(seconds=4))}])
    assert max(r for r in collect(short)["throughput"]["output_tok_s"] if r is not None) == 720 / 4  # its length


@pytest.fixture
def null_run(cli, write_jsonl, tmp_path):
    rows = [{"id": str(i), "prompt": "word " * (i % 7 + 1)} for i in range(20)]
    out = tmp_path / "out"
    result = cli("run", write_jsonl(rows), "-o", out, "--backend", "null", "--model", "smollm2-135m",
                 "--progress", "none", "--max-tokens", "16")
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: `apt-get install -y chromium` (make setup does it)")
def test_flagged_examples_show_in_headless_chromium(tmp_path):
    page = write_report(_results(tmp_path / "out"))
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri())
    assert 'id="js-errors"></pre>' in dom.stdout
    assert len(re.findall(r'<li class="flag-line unusable"', dom.stdout)) == 3  # in_reasoning, not_parsed, empty
    assert re.search(r'data-examples="in_reasoning">.*think-2', dom.stdout, re.S)
    shot = tmp_path / "answers.png"
    _chromium(tmp_path, f"--screenshot={shot}", page.as_uri())
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    import numpy as np

    top = np.asarray(image.crop((0, 0, image.width, 900))).astype(int)
    red = int(((top[..., 0] > 150) & (top[..., 1] < 60) & (top[..., 2] < 60)).sum())
    assert red > 2000, "the unusable flags' red lines are not on the page's first screen"
