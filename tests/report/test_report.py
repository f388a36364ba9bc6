"""qbatch report: builds from a folder with telemetry, from an old one without, and fast on a million rows;
renders in a real headless Chromium (skipped only where none is installed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import polars as pl
import pytest

from qbatch.output.telemetry import write_part, compact
from qbatch.report.page import CHARTS, write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _telemetry(folder: Path, seconds: int = 120) -> None:
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    rows = []
    for s in range(seconds):
        t = start + timedelta(seconds=s)
        rows += [{"time": t, "source": "run", "device": "", "rows_done": s * 10, "rows_total": 2000},
                 {"time": t, "source": "host", "device": "", "cpu_pct": 150.0, "rss_bytes": 2 << 30},
                 {"time": t, "source": "gpu", "device": "0", "gpu_util_pct": 80.0 + s % 10,
                  "gpu_mem_used_bytes": 100 << 30, "gpu_mem_total_bytes": 140 << 30, "gpu_power_w": 450.0},
                 {"time": t, "source": "engine", "device": "engine 0", "requests_in_engine": 300,
                  "requests_running": 256, "requests_waiting": 44, "kv_cache_usage": 0.6, "finished_requests": s * 10,
                  "prompt_tokens": s * 2000, "cached_tokens": s * 500, "generation_tokens": s * 20_000}]
    write_part(folder, rows)
    compact(folder)


@pytest.fixture
def null_run(cli, write_jsonl, tmp_path):
    rows = [{"id": str(i), "prompt": "word " * (i % 50 + 1)} for i in range(300)] + [{"id": "empty", "prompt": ""}]
    out = tmp_path / "out"
    result = cli("run", write_jsonl(rows), "-o", out, "--backend", "null", "--model", "smollm2-135m",
                 "--progress", "none", "--chunk-tokens", "20000", "--max-tokens", "64", "--no-telemetry")
    assert result.exit_code == 0, result.output
    return out


def _charts(page: str) -> set[str]:
    return set(re.findall(r'class="chart" id="chart-(\w+)"', page))


def test_report_from_a_folder_with_telemetry_has_every_chart(null_run):
    _telemetry(null_run)
    page = write_report(null_run).read_text()
    assert _charts(page) == set(CHARTS)
    assert "not recorded" not in page
    assert "<script src=" not in page
    assert "empty_prompt" in page  # the error kind, with its example row
    assert len(page) < 6_000_000


def test_report_of_an_old_folder_says_not_recorded(null_run):
    assert not (null_run / "telemetry.parquet").exists()
    page = write_report(null_run, null_run / "old.html").read_text()
    assert _charts(page) == {"phases", "lengths", "finish_reasons", "chunks"}
    assert page.count("not recorded: this folder has no telemetry.parquet") == 3  # throughput, devices, engines


def test_report_command(cli, null_run, tmp_path):
    result = cli("report", null_run, "-o", tmp_path / "r.html")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(tmp_path / "r.html")
    assert cli("report", tmp_path).exit_code == 1  # not an output folder: Error/Hint, exit 1


def test_report_builds_in_seconds_for_a_million_rows(tmp_path):
    n = 1_000_000
    out = tmp_path / "big"
    out.mkdir()
    pl.DataFrame({"id": pl.int_range(n, eager=True).cast(pl.String), "text": ["ok"] * n,
                  "finish_reason": (["stop"] * 9 + ["length"]) * (n // 10),
                  "prompt_tokens": pl.int_range(n, eager=True) % 900 + 20,
                  "completion_tokens": pl.int_range(n, eager=True) * 7 % 2048 + 1}).write_parquet(out / "results.parquet")
    (out / "manifest.json").write_text(json.dumps({"status": "completed", "spec": {"model": "m"}}))
    (out / "stats.json").write_text(json.dumps({"wall_s": 3600.0, "generate_s": 3500.0, "setup_s": 60.0,
                                                "chunks": [{"index": i, "rows": 2000, "finished_s": 7.0 * i}
                                                           for i in range(500)]}))
    _telemetry(out, seconds=3600)
    t0 = time.monotonic()
    page = write_report(out).read_text()
    elapsed = time.monotonic() - t0
    assert elapsed < 20, f"report took {elapsed:.1f}s"  # ~2-3 s on 2 shared cores (docs/benchmarks.md)
    assert len(page) < 6_000_000 and _charts(page) == set(CHARTS)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: `apt-get install -y chromium` (make setup does it)")
def test_report_renders_in_headless_chromium(null_run, tmp_path):
    _telemetry(null_run)
    page = write_report(null_run)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
             "--virtual-time-budget=5000"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert f'data-charts-drawn="{len(CHARTS)}"' in dom.stdout, dom.stderr[-2000:]
    for key in CHARTS:
        assert re.search(rf'id="chart-{key}"[^>]*data-rendered="1"', dom.stdout), key
    assert 'id="js-errors"></pre>' in dom.stdout  # window.onerror wrote nothing
    assert not re.search(r"CONSOLE.*(Uncaught|Error)", dom.stderr), dom.stderr[-2000:]
    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, *flags, "--window-size=1300,2400", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    colors = image.resize((130, 240)).getcolors(maxcolors=100_000)
    assert colors is not None and len(colors) > 20, "the screenshot is blank"


def test_a_gap_between_two_runs_breaks_the_line():
    """A resumed job's telemetry holds two runs: the charts must not draw a line across the gap."""
    from qbatch.report.data import _break_gaps

    series = {"time": ["2026-12-01 00:00:00", "2026-12-01 00:00:01", "2026-12-01 00:01:00", "2026-12-01 00:01:01"],
              "tok_s": [1, 2, 3, 4], "absent": None}
    broken = _break_gaps(series, 1)
    assert broken["tok_s"] == [1, 2, None, 3, 4] and broken["absent"] is None
    assert broken["time"][2] == "2026-12-01 00:00:02"
    assert _break_gaps({"time": series["time"][:2], "tok_s": [1, 2]}, 1) == {"time": series["time"][:2], "tok_s": [1, 2]}
