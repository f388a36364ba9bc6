"""qbatch report: builds from a folder with telemetry, from an old one without, and fast on a million rows;
its header's numbers from a known telemetry table; a folder's runs split and labelled; settings of
another task hidden; renders in a real headless Chromium with no legend over a title (skipped only
where no Chromium is installed)."""

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

from qbatch.output.manifest import Manifest
from qbatch.output.summary import Summary
from qbatch.output.telemetry import compact, write_part
from qbatch.output.telemetry import read as read_telemetry
from qbatch.report.data import collect
from qbatch.report.glance import glance, phase_split
from qbatch.report.charts import MARKERS_BELOW
from qbatch.report.page import CHARTS, render, write_report
from qbatch.report.timeline import Timeline

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
START = datetime(2026, 1, 1, tzinfo=timezone.utc)
GiB = 1 << 30


def _gpu_rows(t: datetime, s: int, *, gpus: int = 1, engines: int = 1, rate: int = 20_000) -> list[dict]:
    """One sample of a GPU run, `s` seconds into it: per GPU util 80-89% (GPU 1: 20 points less), 450 W
    (GPU 1: 250 W), 100 GiB of 140; per engine cumulative counters of `rate` output tok/s."""
    rows = [{"time": t, "source": "run", "device": "", "rows_done": s * 10, "rows_total": 2000},
            {"time": t, "source": "host", "device": "", "cpu_pct": 150.0, "rss_bytes": 2 * GiB}]
    rows += [{"time": t, "source": "gpu", "device": str(g), "gpu_util_pct": 80.0 + s % 10 - 20 * g,
              "gpu_mem_used_bytes": 100 * GiB, "gpu_mem_total_bytes": 140 * GiB, "gpu_power_w": 450.0 - 200 * g}
             for g in range(gpus)]
    rows += [{"time": t, "source": "engine", "device": f"engine {e}", "requests_in_engine": 300,
              "requests_running": 256, "requests_waiting": 44, "kv_cache_usage": 0.6, "finished_requests": s * 10,
              "prompt_tokens": s * 2000, "cached_tokens": s * 500, "generation_tokens": s * rate}
             for e in range(engines)]
    return rows


def _telemetry(folder: Path, seconds: int = 120, *, start: datetime = START, **kwargs) -> None:
    rows = []
    for s in range(seconds):
        rows += _gpu_rows(start + timedelta(seconds=s), s, **kwargs)
    write_part(folder, rows)
    compact(folder)


def _manifest(folder: Path, runs: list[dict], **extra) -> None:
    manifest = {"status": "completed", "spec": {"model": "m", "task": "generate"}, "runs": runs, **extra}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S%z")


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


def _glance_cards(page: str) -> dict[str, str]:
    return dict(re.findall(r'<div class="card" data-glance="([\w-]+)"><div class="big">([^<]*)</div>', page))


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
    assert _charts(page) == {"lengths", "finish_reasons", "chunks"}
    assert page.count("not recorded: this folder has no telemetry.parquet") == 3  # throughput, devices, engines
    assert set(_glance_cards(page)) == {"tok-s"}  # stats.json's throughput; utilization was not recorded
    assert 'data-glance="phases"><div class="what">where the time went' in page


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
    (out / "stats.json").write_text(json.dumps({"wall_s": 3600.0, "generate_s": 3500.0, "setup_s": 60.0, "rows_ok": n, "completion_tokens": 0,
                                                "chunks": [{"index": i, "rows": 2000, "finished_s": 7.0 * i}
                                                           for i in range(500)]}))
    _telemetry(out, seconds=3600)
    t0 = time.monotonic()
    page = write_report(out).read_text()
    elapsed = time.monotonic() - t0
    assert elapsed < 20, f"report took {elapsed:.1f}s"  # ~2-3 s on 2 shared cores (docs/benchmarks.md)
    assert len(page) < 6_000_000 and _charts(page) == set(CHARTS)


# -- the header ----------------------------------------------------------------
def test_the_header_numbers_come_from_a_known_telemetry_table(tmp_path):
    """Two GPUs (util 84.5% and 64.5% on average, 450 W and 250 W), two engines of 20,000 output tok/s
    each, 100 s of generation: the header says 74.5%, 40,000 tok/s, 20,000 per GPU, 350 W, 19.44 Wh."""
    _telemetry(tmp_path, seconds=101, gpus=2, engines=2)
    _manifest(tmp_path, [{"started_at": _stamp(START - timedelta(seconds=30))}], status="running")
    info = collect(tmp_path)
    g = info["glance"]
    assert (g["gpus"], g["gpu_util_pct"], g["gpu_util_by_gpu"]) == (2, 74.5, {"0": 84.5, "1": 64.5})
    assert (g["tok_s"], g["tok_s_source"], g["tok_s_per_gpu"]) == (40_000.0, "telemetry", 20_000.0)
    assert (g["gpu_power_w"], g["gpu_energy_wh"]) == (350.0, round(700 * 100 / 3600, 2))
    assert (g["gpu_mem_peak_gib"], g["gpu_mem_total_gib"], g["generate_s"]) == (100.0, 140.0, 100.0)
    assert g["run"] == "run 1: killed (no end recorded)"  # status running, and no run holds the folder
    cards = _glance_cards(render(info))
    assert cards == {"gpu-util": "74%", "tok-s": "40,000", "tok-s-gpu": "20,000", "gpu-power": "350 W",
                     "gpu-mem": "100.0 GiB"}


def test_the_header_takes_the_runs_printed_throughput_and_splits_its_wall_time(tmp_path):
    _telemetry(tmp_path, seconds=61)
    _manifest(tmp_path, [{"started_at": _stamp(START - timedelta(seconds=40)), "finished_at": _stamp(START)}])
    stats = {"wall_s": 100.0, "setup_s": 10.0, "engine_start_s": 45.0, "generate_s": 50.0, "assemble_s": 2.0,
             "completion_tokens": 1_000_000, "prompt_tokens": 5, "rows_ok": 100}
    (tmp_path / "stats.json").write_text(json.dumps(stats))
    g = collect(tmp_path)["glance"]
    assert (g["tok_s"], g["tok_s_source"], g["generate_s"]) == (20_000.0, "stats.json", 50.0)
    # engines started beside the setup: only the 38 s waited for after it count; the parts add up to the wall
    assert [(p["name"], p["seconds"]) for p in g["phases"]] == [
        ("setup", 10.0), ("engine start", 38.0), ("generate", 50.0), ("assembly", 2.0), ("wall", 100.0)]
    assert phase_split(Summary(wall_s=10.0, setup_s=1.0, generate_s=2.0))[-2:] == [
        {"name": "other", "seconds": 7.0, "share": 0.7}, {"name": "wall", "seconds": 10.0, "share": 1.0}]
    # a rerun that found every row done writes a stats.json of its own: the throughput and split are then
    # the run that generated (from its telemetry), and the header says why the split is missing
    (tmp_path / "stats.json").write_text(json.dumps({"wall_s": 17.0, "setup_s": 0.1, "generate_s": 0.0, "rows_ok": 0,
                                                      "completion_tokens": 0}))
    info = collect(tmp_path)
    assert (info["glance"]["tok_s"], info["glance"]["tok_s_source"], info["glance"]["phases"]) == (
        20_000.0, "telemetry", None)
    assert "not recorded (the last completed run found every row done)" in render(info)


def test_a_cpu_run_shows_cpu_use_and_no_gpu_numbers(tmp_path):
    rows = [row for s in range(10) for row in _gpu_rows(START + timedelta(seconds=s), s) if row["source"] != "gpu"]
    write_part(tmp_path, rows)
    _manifest(tmp_path, [{"started_at": _stamp(START), "finished_at": _stamp(START + timedelta(seconds=9))}])
    page = render(collect(tmp_path))
    assert _glance_cards(page) == {"cpu-util": "150%", "tok-s": "20,000", "rss": "2.0 GiB"}
    header = page.split('<section class="glance">')[1].split("</section>")[0]
    assert "no GPU recorded" in header and "per GPU" not in header and " W" not in header


# -- runs ----------------------------------------------------------------------
def test_runs_are_drawn_back_to_back_and_labelled(tmp_path):
    """An interrupted run, then a resume an hour later: two labelled spans of the axis, no hour-long gap,
    the line broken between them; a run that left no end (killed, then resumed) says so."""
    second = START + timedelta(hours=1)
    write_part(tmp_path, [row for s in range(60) for row in _gpu_rows(START + timedelta(seconds=s), s)]
               + [row for s in range(31) for row in _gpu_rows(second + timedelta(seconds=s), s, rate=10_000)])
    _manifest(tmp_path, [
        {"started_at": _stamp(START - timedelta(minutes=5))},  # killed before it generated: no samples
        {"started_at": _stamp(START - timedelta(seconds=20)), "interrupted_at": _stamp(START + timedelta(seconds=60)),
         "interrupted_by": "SIGTERM"},
        {"started_at": _stamp(second - timedelta(seconds=20)), "finished_at": _stamp(second + timedelta(seconds=31)),
         "rows_ok": 300, "rows_failed": 2}])
    info = collect(tmp_path)
    labels = [run["label"] for run in info["runs"]]
    assert labels == ["run 1: stopped (failed or killed)", "run 2 (resumed): interrupted by SIGTERM",
                      "run 3 (resumed): completed"]
    assert [run["seconds"] for run in info["runs"]] == [None, 59.0, 30.0]
    assert [run["tok_s"] for run in info["runs"][1:]] == [20_000.0, 10_000.0]
    axis = info["axis"]
    assert axis["unit"] == "s" and axis["title"] == "time generating (s), runs back to back"
    assert [(r["label"], r["x0"], r["x1"]) for r in axis["runs"]] == [
        ("run 2 (resumed): interrupted by SIGTERM", 0.0, 59.0), ("run 3 (resumed): completed", 60.335, 90.335)]
    x, tok_s = info["throughput"]["x"], info["throughput"]["output_tok_s"]
    assert max(x) < 100  # the hour between the runs is not on the axis
    assert tok_s[60] is None and x[59] < x[60] < x[61] == 60.335  # the line breaks between the runs
    saved = [n for n in info["throughput"]["rows_saved"] if n is not None]
    assert saved == sorted(saved) and saved[-1] == 59 * 10 + 30 * 10  # rows saved climbs across the runs
    assert info["glance"]["run"] == "run 3 (resumed): completed"
    page = render(info)
    assert "run 2 (resumed): interrupted by SIGTERM" in page and "<h2>Runs</h2>" in page
    assert "<td>300 / 2</td>" in page


def test_a_short_run_reads_in_seconds_with_each_point_marked(tmp_path):
    write_part(tmp_path, [row for s in range(4) for row in _gpu_rows(START + timedelta(seconds=s), s)])
    _manifest(tmp_path, [{"started_at": _stamp(START), "finished_at": _stamp(START + timedelta(seconds=4))}])
    info = collect(tmp_path)
    assert info["throughput"]["x"] == [0.0, 1.0, 2.0, 3.0] and info["axis"]["unit"] == "s"
    assert info["axis"]["runs"] == []  # one run that completed: nothing to mark
    figures = json.loads(re.search(r'<script id="figures" type="application/json">(.*?)</script>',
                                   render(info)).group(1))
    assert {t["mode"] for t in figures["throughput"]["data"]} == {"lines+markers"}
    assert len(info["throughput"]["x"]) < MARKERS_BELOW


def test_a_long_run_reads_in_minutes_from_few_hundred_points(tmp_path):
    write_part(tmp_path, [{"time": START + timedelta(seconds=s), "source": "gpu", "device": "0", "gpu_util_pct": 50.0}
                          for s in range(7200)])
    timeline = Timeline.of(Manifest(), read_telemetry(tmp_path), live=False)
    assert timeline.unit == ("min", 60) and timeline.bucket_s == 12  # 7,199 s: 600 points of 12 s
    assert glance(Manifest(), None, timeline)["gpu_util_pct"] == 50.0
    assert timeline.runs[0]["label"] == "run: unknown"  # a folder whose manifest lists no run


def test_settings_of_another_task_are_hidden(tmp_path):
    spec = {"model": "m", "max_tokens": 2048, "temperature": 0.7, "n": 1, "normalize": True,
            "embedding_dtype": "float32", "chunk_tokens": 4096}
    _manifest(tmp_path, [], spec={**spec, "task": "embed"})
    page = render(collect(tmp_path))
    settings = page.split("<h3>Settings</h3>")[1].split("</table>")[0]
    assert "<th>embedding_dtype</th>" in settings and "<th>chunk_tokens</th>" in settings
    assert "max_tokens" not in settings and "temperature" not in settings and "<th>n</th>" not in settings
    _manifest(tmp_path, [], spec={**spec, "task": "generate"})
    settings = render(collect(tmp_path)).split("<h3>Settings</h3>")[1].split("</table>")[0]
    assert "<th>max_tokens</th>" in settings and "embedding_dtype" not in settings and "normalize" not in settings


# -- in a browser --------------------------------------------------------------
# Appended to a copy of the page: the boxes of each chart's legend, axis titles and run labels, and any two
# that overlap (Plotly places them; only a browser knows where they land).
OVERLAP_PROBE = """<script>
setTimeout(function () {
  var found = [];
  document.querySelectorAll(".chart").forEach(function (chart) {
    var boxes = [];
    chart.querySelectorAll(".legend .bg, .xtitle, .ytitle, .y2title, .y3title, .annotation").forEach(function (el) {
      var r = el.getBoundingClientRect();
      if (r.width > 0 && r.height > 0) boxes.push([el.getAttribute("class"), r]);
    });
    for (var i = 0; i < boxes.length; i++) for (var j = i + 1; j < boxes.length; j++) {
      var a = boxes[i][1], b = boxes[j][1];
      if (a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom)
        found.push(chart.id + ": " + boxes[i][0] + " / " + boxes[j][0]);
    }
    var plots = Array.from(chart.querySelectorAll(".nsewdrag")).map(function (el) { return el.getBoundingClientRect(); });
    chart.querySelectorAll(".xtitle").forEach(function (el) {  // an x axis title sits below every plot area
      var r = el.getBoundingClientRect();
      plots.forEach(function (p) { if (r.top < p.bottom && p.top < r.bottom && r.left < p.right && p.left < r.right)
        found.push(chart.id + ": xtitle / plot area"); });
    });
  });
  document.body.setAttribute("data-overlaps", found.join("; ") || "none");
}, 1000);
</script></body>"""


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
             "--virtual-time-budget=5000", "--window-size=1300,2400"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)


def _h200_run(start: datetime, seconds: int, *, gpus: int, saved: int) -> list[dict]:
    """Synthetic telemetry shaped like a real H200 run, one engine per GPU: busy within seconds, draining at
    the end (the last rows); power follows utilization, memory is taken whole at the engine's start."""
    import math

    rows, tokens, finished = [], [0.0] * gpus, [0.0] * gpus
    for s in range(seconds):
        t = start + timedelta(seconds=s)
        ramp, tail = min(1.0, (s + 1) / 4), max(0.0, (s - (seconds - 8)) / 8)
        rows.append({"time": t, "source": "host", "device": "", "cpu_pct": 160.0 + 20 * math.sin(s), "rss_bytes": 9 * GiB})
        for g in range(gpus):
            util = max(0.0, min(100.0, 95 * ramp * (1 - 0.75 * tail) + 3 * math.sin(1.3 * s + g) - 2 * g))
            tokens[g] += 17_000 * util / 95
            finished[g] += 17_000 * util / 95 / 240
            in_engine = int(512 * (1 - tail))
            rows.append({"time": t, "source": "gpu", "device": str(g), "gpu_util_pct": round(util),
                         "gpu_mem_used_bytes": 128 * GiB, "gpu_mem_total_bytes": 143_771 << 20,
                         "gpu_power_w": round(90 + 5.8 * util, 1)})
            rows.append({"time": t, "source": "engine", "device": f"worker {g} (GPU {g})", "requests_in_engine": in_engine,
                         "requests_running": min(256, in_engine), "requests_waiting": max(0, in_engine - 256),
                         "kv_cache_usage": 0.05 + 0.5 * (1 - tail), "finished_requests": int(finished[g]),
                         "prompt_tokens": int(finished[g]) * 180, "cached_tokens": int(finished[g]) * 40,
                         "generation_tokens": int(tokens[g])})
        rows.append({"time": t, "source": "run", "device": "", "rows_total": 4096,
                     "rows_done": min(saved, int(sum(finished)) // 128 * 128)})
    return rows


def gpu_folder(folder: Path) -> Path:
    """An output folder of a job on two GPUs, interrupted then resumed, from synthetic telemetry (`_h200_run`)."""
    folder.mkdir(parents=True, exist_ok=True)
    second = START + timedelta(minutes=30)
    write_part(folder, _h200_run(START, 40, gpus=2, saved=2304) + _h200_run(second, 25, gpus=2, saved=1792))
    compact(folder)
    _manifest(folder, [{"started_at": _stamp(START - timedelta(seconds=50)),
                        "interrupted_at": _stamp(START + timedelta(seconds=40)), "interrupted_by": "SIGTERM"},
                       {"started_at": _stamp(second - timedelta(seconds=30)),
                        "finished_at": _stamp(second + timedelta(seconds=26)), "rows_ok": 1792, "rows_failed": 0}],
              counts={"rows_ok": 4096, "rows_failed": 0}, updated_at=_stamp(second + timedelta(seconds=26)),
              spec={"model": "Qwen/Qwen3-0.6B", "task": "generate", "data_parallel_size": 2, "max_tokens": 2048},
              versions={"qbatch": "synthetic telemetry", "vllm": "-"})
    (folder / "stats.json").write_text(json.dumps({"wall_s": 58.0, "setup_s": 5.0, "engine_start_s": 28.0,
                                                   "rows_ok": 1792, "generate_s": 24.0, "assemble_s": 1.0, "completion_tokens": 700_000,
                                                   "chunks": [{"index": i, "rows": 224, "finished_s": 3.0 * i + 3}
                                                              for i in range(8)]}))
    pl.DataFrame({"id": [str(i) for i in range(4096)], "finish_reason": ["stop"] * 3500 + ["length"] * 596,
                  "prompt_tokens": [i % 300 + 20 for i in range(4096)],
                  "completion_tokens": [i * 7 % 512 + 1 for i in range(4096)]}).write_parquet(folder / "results.parquet")
    return folder


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: `apt-get install -y chromium` (make setup does it)")
def test_report_renders_in_headless_chromium_with_no_overlaps(tmp_path):
    page = write_report(gpu_folder(tmp_path / "gpu"))
    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text().replace("</body>", OVERLAP_PROBE))
    dom = _chromium(tmp_path, "--dump-dom", probed.as_uri())
    assert f'data-charts-drawn="{len(CHARTS)}"' in dom.stdout, dom.stderr[-2000:]
    for key in CHARTS:
        assert re.search(rf'id="chart-{key}"[^>]*data-rendered="1"', dom.stdout), key
    assert 'id="js-errors"></pre>' in dom.stdout  # window.onerror wrote nothing
    assert not re.search(r"CONSOLE.*(Uncaught|Error)", dom.stderr), dom.stderr[-2000:]
    assert 'data-overlaps="none"' in dom.stdout, re.search(r'data-overlaps="[^"]*"', dom.stdout)
    assert dom.stdout.count("run 2 (resumed): completed") >= 5  # the header, the runs table, each time chart
    shot = tmp_path / "report.png"
    _chromium(tmp_path, f"--screenshot={shot}", page.as_uri())
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    colors = image.resize((130, 240)).getcolors(maxcolors=100_000)
    assert colors is not None and len(colors) > 20, "the screenshot is blank"
