"""`qbatch report`: one self-contained HTML page about a run (Plotly's script and the data inline).

The page works offline: plotly.min.js (from the `plotly` package) and every chart's data are
written into it; nothing loads from a CDN. Charts are Plotly figure dicts built here from the
aggregates of data.py, so the page's size does not grow with the rows (a million-row run is a
few hundred numbers per chart, plus the ~4.8 MB script). A section whose data the folder does
not hold says "not recorded" and why.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from qbatch._fs import atomic_write
from qbatch.errors import MissingDependency, OutputError
from qbatch.report import data as report_data

REPORT_NAME = "report.html"
# every chart the page can hold, in page order: tests check that each one renders
CHARTS = ("throughput", "devices", "engines", "phases", "lengths", "finish_reasons", "chunks")


def write_report(output_dir: str | Path, path: str | Path | None = None) -> Path:
    """Build the report of OUT_DIR into `path` (default OUT_DIR/report.html), atomically; its path."""
    folder = Path(output_dir)
    if not (folder / "manifest.json").exists():
        raise OutputError("not a qbatch output folder (no manifest.json)", where=str(folder),
                          hint="pass the -o folder of a qbatch run")
    target = Path(path) if path else folder / REPORT_NAME
    page = render(report_data.collect(folder))
    atomic_write(target, lambda tmp: tmp.write_text(page, encoding="utf-8"))
    return target


def plotly_js() -> str:
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise MissingDependency("qbatch report needs plotly (its script is embedded in the page)",
                                hint="pip install 'qbatch[report]'") from None
    return get_plotlyjs()


def render(info: dict[str, Any]) -> str:
    manifest, stats = info["manifest"], info["stats"]
    missing = NO_ENGINE if info["telemetry_recorded"] else NO_TELEMETRY
    figures: dict[str, Any] = {}
    sections = [
        _section("Throughput", "throughput", _throughput(info["throughput"]) or missing, figures,
                 "output tokens/s and rows/s, from the engines' counters"),
        _section("GPU utilization and memory" if info["devices"] else "CPU and memory (no GPU recorded)",
                 "devices", _devices(info["devices"], info["host"]), figures, "per GPU, or this host's processes"),
        _section("Engines: KV cache and requests", "engines", _engines(info["engines"], info["throughput"]) or missing, figures,
                 "requests in each engine; running/waiting and KV-cache usage with --enable-log-stats"),
        _section("Where the time went", "phases", _phases(info["phases"]), figures, "stats.json, the last run"),
        _section("Prompt and output lengths", "lengths", _lengths(info["lengths"]), figures, "tokens per row"),
        _section("Finish reasons", "finish_reasons", _finish(info["finish_reasons"]), figures, "rows per reason"),
        _section("Per-chunk timings", "chunks", _chunks(info["chunks"]), figures,
                 "seconds between chunk completions, and rows per chunk (stats.json)"),
        _errors_section(info["errors"]),
        _settings_section(manifest),
    ]
    counts = manifest.get("counts") or {}
    summary = [("status", manifest.get("status", "unknown")), ("model", (manifest.get("spec") or {}).get("model")),
               ("rows ok / failed", f"{counts.get('rows_ok', stats.get('rows_ok', '?'))} / "
                                    f"{counts.get('rows_failed', stats.get('rows_failed', '?'))}"),
               ("output tok/s (generate)", stats.get("output_tok_s")), ("wall", _seconds(stats.get("wall_s"))),
               ("updated", manifest.get("updated_at"))]
    title = f"qbatch report: {info['output_dir']}"
    return TEMPLATE.format(
        title=html.escape(title), heading=html.escape(title), summary=_table(summary),
        sections="\n".join(sections), plotly=plotly_js(),
        figures=json.dumps(figures, separators=(",", ":")).replace("</", "<\\/"),
    )


def _section(title: str, key: str, figure: dict[str, Any] | str, figures: dict[str, Any], note: str) -> str:
    """A chart, or the reason it is missing (figure is then that reason's text)."""
    if isinstance(figure, str):
        body = f'<p class="missing" data-chart="{key}">not recorded: {html.escape(figure)}</p>'
    else:
        figures[key] = figure
        body = f'<div class="chart" id="chart-{key}" data-chart="{key}"></div>'
    return f'<section><h2>{html.escape(title)}</h2><p class="note">{html.escape(note)}</p>{body}</section>'


def _layout(**changes: Any) -> dict[str, Any]:
    layout = {"margin": {"l": 60, "r": 60, "t": 30, "b": 50}, "height": 320, "legend": {"orientation": "h", "y": -0.28},
              "template": None, "hovermode": "x unified"}
    layout.update(changes)
    return layout


NO_TELEMETRY = "this folder has no telemetry.parquet (a run before telemetry, or run with --no-telemetry)"
NO_ENGINE = "telemetry.parquet holds no engine counters (the null engine keeps none)"


def _throughput(series: dict[str, Any] | None) -> dict[str, Any] | None:
    if series is None:
        return None
    return {"data": [
        {"type": "scatter", "mode": "lines", "name": "output tok/s", "x": series["time"], "y": series["output_tok_s"]},
        {"type": "scatter", "mode": "lines", "name": "rows/s", "x": series["time"], "y": series["rows_s"], "yaxis": "y2"},
    ], "layout": _layout(yaxis={"title": {"text": "output tok/s"}, "rangemode": "tozero"},
                         yaxis2={"title": {"text": "rows/s"}, "overlaying": "y", "side": "right", "rangemode": "tozero"})}


def _devices(gpus: dict[str, Any] | None, host: dict[str, Any] | None) -> dict[str, Any] | str:
    if gpus:
        traces = []
        for device, s in gpus.items():
            traces.append({"type": "scatter", "mode": "lines", "name": f"GPU {device} util %", "x": s["time"],
                           "y": s["gpu_util_pct"]})
            traces.append({"type": "scatter", "mode": "lines", "name": f"GPU {device} memory GiB", "x": s["time"],
                           "y": s["gpu_mem_used_bytes"], "yaxis": "y2", "line": {"dash": "dot"}})
        return {"data": traces, "layout": _layout(yaxis={"title": {"text": "utilization %"}, "range": [0, 105]},
                                                  yaxis2={"title": {"text": "memory used GiB"}, "overlaying": "y",
                                                          "side": "right", "rangemode": "tozero"})}
    if host is None:
        return NO_TELEMETRY
    return {"data": [
        {"type": "scatter", "mode": "lines", "name": "CPU % (of one core)", "x": host["time"], "y": host["cpu_pct"]},
        {"type": "scatter", "mode": "lines", "name": "RSS GiB", "x": host["time"], "y": host["rss_bytes"], "yaxis": "y2",
         "line": {"dash": "dot"}},
    ], "layout": _layout(yaxis={"title": {"text": "CPU %"}, "rangemode": "tozero"},
                         yaxis2={"title": {"text": "RSS GiB"}, "overlaying": "y", "side": "right", "rangemode": "tozero"})}


def _engines(engines: dict[str, Any] | None, throughput: dict[str, Any] | None) -> dict[str, Any] | None:
    if engines is None:
        return None
    traces = []
    for label, s in engines.items():
        for column, name in (("requests_in_engine", "requests in engine"), ("requests_running", "running"),
                             ("requests_waiting", "waiting")):
            if s[column] is not None:
                traces.append({"type": "scatter", "mode": "lines", "name": f"{label}: {name}", "x": s["time"],
                               "y": s[column]})
        if s["kv_cache_usage"] is not None:
            traces.append({"type": "scatter", "mode": "lines", "name": f"{label}: KV cache %", "x": s["time"],
                           "y": s["kv_cache_usage"], "yaxis": "y2", "line": {"dash": "dot"}})
    if throughput is not None:
        traces.append({"type": "scatter", "mode": "lines", "name": "prefix-cache hit %", "x": throughput["time"],
                       "y": throughput["prefix_cache_hit_pct"], "yaxis": "y2", "line": {"dash": "dash"}})
    return {"data": traces, "layout": _layout(yaxis={"title": {"text": "requests"}, "rangemode": "tozero"},
                                              yaxis2={"title": {"text": "%"}, "overlaying": "y", "side": "right",
                                                      "range": [0, 105]})}


def _phases(phases: dict[str, float] | None) -> dict[str, Any] | str:
    if phases is None:
        return "no stats.json (the run has not finished yet, or it stopped before its end)"
    names = [n for n in phases if n != "wall"]
    return {"data": [{"type": "bar", "orientation": "h", "name": n, "y": ["run"], "x": [phases[n]],
                      "text": [f"{n} {phases[n]:.1f}s"], "textposition": "inside"} for n in names],
            "layout": _layout(barmode="stack", height=200, hovermode="closest",
                              xaxis={"title": {"text": f"seconds (wall {phases['wall']:.1f}s; engine start "
                                                       "overlaps setup when engines start early)"}})}


def _lengths(lengths: dict[str, Any] | None) -> dict[str, Any] | str:
    if lengths is None:
        return "no results yet"
    traces = []
    for column, name, axis in (("prompt_tokens", "prompt tokens", "x"), ("completion_tokens", "output tokens", "x2")):
        h = lengths.get(column)
        if h:
            traces.append({"type": "bar", "name": f"{name} (mean {h['mean']}, max {h['max']})",
                           "x": [b + h["width"] / 2 for b in h["bin"]], "y": h["count"], "width": h["width"],
                           "xaxis": axis, "yaxis": "y" if axis == "x" else "y2"})
    return {"data": traces, "layout": _layout(grid={"rows": 1, "columns": 2, "pattern": "independent"},
                                              hovermode="closest", xaxis={"title": {"text": "prompt tokens"}},
                                              xaxis2={"title": {"text": "output tokens"}},
                                              yaxis={"title": {"text": "rows"}})}


def _finish(reasons: dict[str, int] | None) -> dict[str, Any] | str:
    if not reasons:
        return "no results yet"
    return {"data": [{"type": "bar", "x": list(reasons), "y": list(reasons.values()), "text": list(reasons.values()),
                      "textposition": "auto"}], "layout": _layout(height=260, hovermode="closest",
                                                                  yaxis={"title": {"text": "rows"}})}


def _chunks(chunks: dict[str, Any] | None) -> dict[str, Any] | str:
    if chunks is None:
        return "no per-chunk timings in stats.json (the run has not finished yet)"
    return {"data": [
        {"type": "bar", "name": "seconds since the previous chunk", "x": chunks["finished_s"], "y": chunks["seconds"],
         "customdata": chunks["index"], "hovertemplate": "chunk %{customdata}: %{y:.2f}s"},
        {"type": "scatter", "mode": "markers", "name": "rows", "x": chunks["finished_s"], "y": chunks["rows"],
         "yaxis": "y2"},
    ], "layout": _layout(hovermode="closest", xaxis={"title": {"text": "finished at (s after generation began)"}},
                         yaxis={"title": {"text": "seconds"}}, yaxis2={"title": {"text": "rows"}, "overlaying": "y",
                                                                       "side": "right", "rangemode": "tozero"})}


def _errors_section(kinds: list[dict[str, Any]] | None) -> str:
    if kinds is None:
        body = '<p class="missing">not recorded: no errors.parquet or error parts yet</p>'
    elif not kinds:
        body = "<p>No row failed.</p>"
    else:
        rows = "".join(
            f"<tr><td>{html.escape(k['error'])}</td><td>{k['rows']:,}</td><td><ul>"
            + "".join(f"<li><code>{html.escape(str(e['id']))}</code>: {html.escape(str(e['message']))}</li>"
                      for e in k["examples"]) + "</ul></td></tr>" for k in kinds)
        body = f"<table><tr><th>error</th><th>rows</th><th>examples</th></tr>{rows}</table>"
    return f"<section><h2>Errors</h2>{body}</section>"


def _settings_section(manifest: dict[str, Any]) -> str:
    spec = manifest.get("spec") or {}
    versions = manifest.get("versions") or {}
    settings = _table([(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in sorted(spec.items())
                       if v is not None]) if spec else '<p class="missing">not recorded</p>'
    versions_table = _table(sorted(versions.items())) if versions else '<p class="missing">not recorded</p>'
    return (f"<section><h2>Settings and versions</h2><div class=\"two\"><div><h3>Settings</h3>{settings}</div>"
            f"<div><h3>Versions</h3>{versions_table}</div></div></section>")


def _table(rows: list[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape('' if v is None else str(v))}</td></tr>"
                   for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _seconds(value: Any) -> str | None:
    return None if value is None else f"{float(value):.1f}s"


TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 17px; margin-bottom: 2px; }} h3 {{ font-size: 14px; }}
section {{ border-top: 1px solid #ddd; padding-top: 6px; margin-top: 14px; }}
.note {{ color: #666; font-size: 12px; margin-top: 0; }} .missing {{ color: #a05a00; font-style: italic; }}
table {{ border-collapse: collapse; font-size: 13px; }} td, th {{ border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }}
table.kv th {{ background: #f6f6f6; font-weight: 600; }} .two {{ display: flex; gap: 24px; flex-wrap: wrap; }}
#js-errors {{ color: #b00; }}
</style></head><body>
<h1>{heading}</h1>
{summary}
{sections}
<pre id="js-errors"></pre>
<script>window.onerror = function (m) {{ document.getElementById("js-errors").textContent += "error: " + m + "\\n"; }};</script>
<script>{plotly}</script>
<script id="figures" type="application/json">{figures}</script>
<script>
(function () {{
  var figures = JSON.parse(document.getElementById("figures").textContent);
  var drawn = 0;
  Object.keys(figures).forEach(function (key) {{
    var el = document.getElementById("chart-" + key);
    Plotly.newPlot(el, figures[key].data, figures[key].layout, {{displaylogo: false, responsive: true}});
    if (el.querySelector(".main-svg")) {{ el.setAttribute("data-rendered", "1"); drawn += 1; }}
  }});
  document.body.setAttribute("data-charts-drawn", String(drawn));
}})();
</script>
</body></html>
"""
