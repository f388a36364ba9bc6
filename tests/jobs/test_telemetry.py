"""Telemetry: the sampler writes the documented columns as atomic parts, compacts them, stays bounded."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import polars as pl
import pytest

from qbatch.engines.messages import EngineSample
from qbatch.jobs.telemetry import Telemetry
from qbatch.output.telemetry import COLUMNS, TELEMETRY_FILE, compact, part_files, read, thin, write_part


class FakeEngine:
    def __init__(self):
        self.generated = 0

    def telemetry(self):
        self.generated += 100
        return [("engine 0", EngineSample(5, self.generated // 10, 1000, 250, self.generated))]


def test_sampler_writes_documented_columns_and_compacts(tmp_path):
    progress = SimpleNamespace(rows_ok=3, rows_failed=1, completion_tokens=90)
    with Telemetry(tmp_path, progress, rows_total=10, sample_s=0.05, flush_s=0.2) as telemetry:
        telemetry.engine = FakeEngine()
        deadline = time.monotonic() + 30
        while not part_files(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert part_files(tmp_path), "parts are written while the run works"
    assert not part_files(tmp_path) and (tmp_path / TELEMETRY_FILE).exists()
    frame = pl.read_parquet(tmp_path / TELEMETRY_FILE)
    assert frame.columns == list(COLUMNS)
    assert set(frame["source"]) == {"run", "host", "engine"}  # no GPU here
    run = frame.filter(pl.col("source") == "run")
    assert run["rows_done"].to_list()[-1] == 4 and run["rows_total"].to_list()[-1] == 10
    host = frame.filter(pl.col("source") == "host")
    assert host["rss_bytes"].min() > 0
    engine = frame.filter(pl.col("source") == "engine")
    assert engine["generation_tokens"].is_sorted() and engine["requests_running"].null_count() == engine.height


def test_thin_bounds_rows_and_keeps_the_last_hour_whole(tmp_path):
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    day = [{"time": start + timedelta(seconds=s), "source": "run", "device": "", "rows_done": s}
           for s in range(0, 86_400, 2)]
    for i in range(0, len(day), 10_000):
        write_part(tmp_path, day[i:i + 10_000])
    compact(tmp_path, max_rows=10_000, keep_recent_s=3600)
    frame = read(tmp_path)
    assert frame.height <= 10_000
    recent = frame.filter(pl.col("time") >= start + timedelta(seconds=86_400 - 3600))
    assert recent.height == 1800  # every sample of the last hour
    assert frame["rows_done"].to_list()[0] == 0  # the start is kept, sparser


def test_thin_caps_even_a_short_dense_run():
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    frame = pl.DataFrame({"time": [start + timedelta(seconds=s) for s in range(1000)], "source": ["run"] * 1000})
    assert thin(frame, max_rows=100, keep_recent_s=3600).height <= 100


@pytest.mark.parametrize("telemetry", ["--telemetry", "--no-telemetry"])
def test_null_run_records_telemetry_unless_told_not_to(cli, write_jsonl, tmp_path, telemetry):
    src = write_jsonl([{"id": str(i), "prompt": f"p {i}"} for i in range(20)])
    out = tmp_path / "out"
    result = cli("run", src, "-o", out, "--backend", "null", "--model", "smollm2-135m", "--progress", "none",
                 telemetry)
    assert result.exit_code == 0, result.output
    assert (out / TELEMETRY_FILE).exists() == (telemetry == "--telemetry")
