"""`qbatch report`: one self-contained HTML page about a run (Plotly's script and the data inline).

The page works offline: Plotly's basic bundle (scatter and bar traces, all the charts use; MIT,
vendored in report/vendor/, 1.2 MB against the full bundle's 4.8 MB) and every chart's data are
written into it once; nothing loads from a CDN. It opens with what a deployment is judged by (GPU or
CPU utilization while generating, tok/s and tok/s per GPU, power, memory, where the time went:
glance.py), then the runs of the folder, then the flagged answers with examples, then the charts:
Plotly figure dicts (charts.py) built from the aggregates of data.py, so the page's size does not grow
with the rows (a million-row run is a few hundred numbers per chart, and a few example rows). A
section whose data the folder does not hold says "not recorded" and why.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from qbatch._fs import atomic_write, normal_path
from qbatch.errors import OutputError
from qbatch.output.manifest import Manifest
from qbatch.output.recorded_plan import full_lines, summary_lines
from qbatch.output.summary import Summary
from qbatch.report import charts, data as report_data
from qbatch.report.answers import answers_section
from qbatch.report.charts import NO_ENGINE, NO_TELEMETRY
from qbatch.spec import applies_to

REPORT_NAME = "report.html"
# every chart the page can hold, in page order: tests check that each one renders
CHARTS = ("throughput", "devices", "engines", "lengths", "finish_reasons", "chunks")
PHASE_COLORS = {"setup": "#4c78a8", "engine start": "#f58518", "generate": "#54a24b", "assembly": "#e45756",
                "other": "#bab0ac"}


def write_report(output_dir: str | Path, path: str | Path | None = None) -> Path:
    """Build the report of OUT_DIR into `path` (default OUT_DIR/report.html), atomically; its path."""
    folder = Path(normal_path(output_dir))
    if not (folder / "manifest.json").exists():
        raise OutputError("not a qbatch output folder (no manifest.json)", where=str(folder),
                          hint="pass the -o folder of a qbatch run")
    target = Path(normal_path(path)) if path else folder / REPORT_NAME
    page = render(report_data.collect(folder))
    atomic_write(target, lambda tmp: tmp.write_text(page, encoding="utf-8"))
    return target


PLOTLY_JS = Path(__file__).with_name("vendor") / "plotly-basic.min.js"  # plotly.js-basic-dist-min 4.1.1 (npm)


def plotly_js() -> str:
    """Plotly's basic bundle: the scatter and bar traces the charts draw, and the layout they use."""
    return PLOTLY_JS.read_text(encoding="utf-8")


def render(info: dict[str, Any]) -> str:
    manifest, glance = info["manifest"], info["glance"]
    missing = NO_ENGINE if info["telemetry_recorded"] else NO_TELEMETRY
    axis = info["axis"]
    figures: dict[str, Any] = {}
    tokens_of = glance["tokens_of"]
    sections = [
        _section("Throughput", "throughput", charts.throughput(info["throughput"], axis, tokens_of) or missing, figures,
                 f"{tokens_of} tokens/s from the engines' counters (rows/s: click its legend), and rows written "
                 "to the results"),
        _section("GPU utilization, memory and power" if info["devices"] else "CPU and memory (no GPU recorded)",
                 "devices", charts.devices(info["devices"], info["host"], axis), figures,
                 "per GPU (NVML), or this run's processes"),
        _section("Engines: KV cache and requests", "engines", charts.engines(info["engines"], info["throughput"], axis)
                 or missing, figures, "requests in each engine; running/waiting and KV-cache usage with --enable-log-stats"),
        _section("Prompt and output lengths", "lengths", charts.lengths(info["lengths"]), figures, "tokens per row"),
        _section("Finish reasons", "finish_reasons", charts.finish(info["finish_reasons"]), figures, "rows per reason"),
        _section("Per-chunk timings", "chunks", charts.chunks(info["chunks"]), figures,
                 "seconds between chunk completions, and rows per chunk (stats.json: the last completed run)"),
        _adapters_section(info.get("adapters")),
        _errors_section(info["errors"]),
        _plan_section(manifest.plan),
        _settings_section(manifest),
    ]
    title = f"qbatch report: {info['output_dir']}"
    return TEMPLATE.format(
        title=html.escape(title), heading=html.escape(title), glance=_glance(info),
        runs=_runs_section(info["runs"], glance), answers=answers_section(info.get("answers")),
        sections="\n".join(sections), plotly=plotly_js(),
        figures=json.dumps(figures, separators=(",", ":")).replace("</", "<\\/"),
    )


# -- the header --------------------------------------------------------------
def _glance(info: dict[str, Any]) -> str:
    """The header: status and rows, then one card per number a deployment is judged by, then the phase split."""
    manifest, stats, g = info["manifest"], info["stats"], info["glance"]
    ran = {"rows_ok": stats.rows_ok, "rows_failed": stats.rows_failed} if stats else {}
    counts = {**ran, **(manifest.counts or {})}  # the manifest's, else the last run's
    facts = [("status", manifest.status), ("model", manifest.spec.get("model")),
             ("rows ok / failed", f"{_count(counts.get('rows_ok'))} / {_count(counts.get('rows_failed'))}"),
             ("updated", manifest.updated_at)]
    cards = []
    if g["gpus"]:
        by_gpu = g.get("gpu_util_by_gpu") or {}
        detail = ", ".join(f"GPU {d}: {_pct(u)}" if len(by_gpu) > 1 else f"GPU {d}" for d, u in by_gpu.items())
        cards.append(("gpu-util", _pct(g["gpu_util_pct"]), "mean GPU utilization while generating", detail))
    elif g.get("cpu_pct") is not None:
        cards.append(("cpu-util", _pct(g["cpu_pct"]), "mean CPU while generating",
                      "this run's processes, % of one core (no GPU recorded)"))
    if g["tok_s"] is not None:
        source = "stats.json" if g["tok_s_source"] == "stats.json" else "the engines' counters"
        cards.append(("tok-s", f"{g['tok_s']:,.0f}", f"{g['tokens_of']} tok/s while generating",
                      f"over {_secs(g['generate_s'])}, from {source}"))
    roofline = stats.roofline if stats and g["tok_s_source"] == "stats.json" else None
    if isinstance(roofline, dict) and roofline.get("share") is not None:
        cards.append(("roofline", _pct(100 * roofline["share"]), "of what this GPU can do for this work",
                      f"its roofline: {roofline.get('seconds')}s at best, {roofline.get('bound')}-bound "
                      f"({roofline.get('gpus')}x {roofline.get('gpu')})"))
    if g.get("tok_s_per_gpu") is not None:
        cards.append(("tok-s-gpu", f"{g['tok_s_per_gpu']:,.0f}", f"{g['tokens_of']} tok/s per GPU",
                      f"{g['gpus']} GPU{'s' if g['gpus'] > 1 else ''}"))
    if g.get("gpu_power_w") is not None:
        cards.append(("gpu-power", f"{g['gpu_power_w']:,.0f} W", "mean power per GPU",
                      f"{g['gpu_energy_wh']:,.2f} Wh while generating, all GPUs"))
    if g.get("gpu_mem_peak_gib") is not None:
        total = f" of {g['gpu_mem_total_gib']:,.1f}" if g.get("gpu_mem_total_gib") else ""
        cards.append(("gpu-mem", f"{g['gpu_mem_peak_gib']:,.1f} GiB", "peak GPU memory used",
                      f"{total.strip()} GiB per GPU" if total else ""))
    elif g.get("rss_peak_gib") is not None:
        cards.append(("rss", f"{g['rss_peak_gib']:,.1f} GiB", "peak memory (RSS)", "this run's processes"))
    which = (f'<p class="note">numbers of {html.escape(g["run"])} (the last run that generated, of {g["runs"]})</p>'
             if g["run"] and g["runs"] > 1 else "")
    if not cards:
        which = '<p class="missing">not recorded: no telemetry and no stats.json with generation</p>'
    card_html = "".join(f'<div class="card" data-glance="{key}"><div class="big">{html.escape(value)}</div>'
                        f'<div class="what">{html.escape(what)}</div><div class="detail">{html.escape(detail)}</div></div>'
                        for key, value, what, detail in cards)
    return (f'<section class="glance">{_table(facts)}<div class="cards">{card_html}</div>{which}'
            f'{_phase_bar(g["phases"], stats)}</section>')


def _phase_bar(phases: list[dict[str, Any]] | None, stats: Summary | None) -> str:
    """Where the wall time went, as one bar of proportional parts with their seconds and shares."""
    if not phases:
        why = ("the last completed run found every row done" if stats and stats.wall_s
               else "no stats.json: the run has not completed yet")
        return f'<p class="missing" data-glance="phases">where the time went: not recorded ({why})</p>'
    parts = [p for p in phases if p["name"] != "wall"]
    wall = phases[-1]["seconds"]
    bar = "".join(f'<span style="flex-grow:{max(p["share"], 0.002):.4f};background:{PHASE_COLORS[p["name"]]}" '
                  f'title="{p["name"]} {p["seconds"]:.1f}s"></span>' for p in parts)
    legend = " ".join(f'<span class="key"><i style="background:{PHASE_COLORS[p["name"]]}"></i>{html.escape(p["name"])} '
                      f'{p["seconds"]:.1f}s ({p["share"]:.0%})</span>' for p in parts)
    return (f'<div class="phases" data-glance="phases"><div class="what">where the time went: wall {wall:.1f}s '
            f'(the last completed run; engine start counts the wait after the setup)</div>'
            f'<div class="bar">{bar}</div><div class="keys">{legend}</div></div>')


def _runs_section(runs: list[dict[str, Any]], glance: dict[str, Any]) -> str:
    """The folder's runs, one line each: how it ended and what it generated. Only when there are several."""
    if len(runs) < 2:
        return ""
    gpu = glance["gpus"] > 0
    head = ["run", "started", "ended", "generating", "rows ok / failed", f"{glance['tokens_of']} tok/s",
            "mean GPU util" if gpu else "mean CPU"]
    lines = []
    for run in runs:
        util = run.get("gpu_util_pct") if gpu else run.get("cpu_pct")
        rows = "" if run.get("rows_ok") is None else f"{run['rows_ok']:,} / {run.get('rows_failed') or 0:,}"
        cells = [run["label"], run.get("started_at") or "", run.get("ended_at") or "",
                 _generating(run), rows,
                 "" if run.get("tok_s") is None else f"{run['tok_s']:,.0f}", "" if util is None else _pct(util)]
        lines.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    header = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return (f'<section><h2>Runs</h2><p class="note">this folder\'s runs of the job: the charts draw them back to '
            f'back, each labelled</p><table class="runs"><tr>{header}</tr>{"".join(lines)}</table></section>')


def _generating(run: dict[str, Any]) -> str:
    if run.get("seconds") is not None:
        return _secs(run["seconds"])
    return "nothing to do" if run.get("rows_ok") == 0 and run.get("rows_failed") == 0 else "no telemetry"


def _section(title: str, key: str, figure: dict[str, Any] | str, figures: dict[str, Any], note: str) -> str:
    """A chart, or the reason it is missing (figure is then that reason's text)."""
    if isinstance(figure, str):
        body = f'<p class="missing" data-chart="{key}">not recorded: {html.escape(figure)}</p>'
    else:
        figures[key] = figure
        body = f'<div class="chart" id="chart-{key}" data-chart="{key}"></div>'
    return f'<section><h2>{html.escape(title)}</h2><p class="note">{html.escape(note)}</p>{body}</section>'


# -- tables ------------------------------------------------------------------
def _adapters_section(adapters: list[dict[str, Any]] | None) -> str:
    """Rows and tokens per LoRA adapter (jobs with --lora only)."""
    if not adapters:
        return ""
    rows = "".join(f"<tr><td>{html.escape(a['adapter'] or '(base model)')}</td><td>{a['rows']:,}</td>"
                   f"<td>{a['prompt_tokens']:,}</td><td>{a['completion_tokens']:,}</td></tr>" for a in adapters)
    return ("<section><h2>LoRA adapters</h2><table><tr><th>adapter</th><th>rows</th><th>prompt tokens</th>"
            f"<th>output tokens</th></tr>{rows}</table></section>")


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


def _plan_section(recorded: dict[str, Any] | None) -> str:
    """What vLLM got (every LLM(...) argument and environment variable, each with why) and where the engines ran."""
    if not recorded:
        return ('<section><h2>Engine plan</h2><p class="missing">not recorded (a run of a qbatch that did not '
                'record it)</p></section>')
    lines = "".join(f"<li><code>{html.escape(line)}</code></li>" for line in full_lines(recorded))
    summary = html.escape("; ".join(summary_lines(recorded)))
    return (f'<section><h2>Engine plan</h2><p class="note">{summary}</p><ul class="plan">{lines}</ul>'
            '</section>')


def _settings_section(manifest: Manifest) -> str:
    """The run's settings that were set and apply to its task (an embedding job's sampling does not), and versions."""
    spec = manifest.spec
    task = manifest.task or "generate"
    versions = manifest.versions or {}
    shown = [(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in sorted(spec.items())
             if v is not None and applies_to(k, task)]
    settings = _table(shown) if spec else '<p class="missing">not recorded</p>'
    versions_table = _table(sorted(versions.items())) if versions else '<p class="missing">not recorded</p>'
    return (f"<section><h2>Settings and versions</h2><div class=\"two\"><div><h3>Settings</h3>{settings}</div>"
            f"<div><h3>Versions</h3>{versions_table}</div></div></section>")


def _table(rows: list[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape('' if v is None else str(v))}</td></tr>"
                   for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _count(value: Any) -> str:
    return "?" if value is None else f"{value:,}"


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}%"


def _secs(value: float | None) -> str:
    return "?" if value is None else f"{value:,.1f}s"


TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; padding: 0 12px; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 17px; margin-bottom: 2px; }} h3 {{ font-size: 14px; }}
section {{ border-top: 1px solid #ddd; padding-top: 6px; margin-top: 14px; }}
.note {{ color: #666; font-size: 12px; margin-top: 0; }} .missing {{ color: #a05a00; font-style: italic; }}
table {{ border-collapse: collapse; font-size: 13px; }} td, th {{ border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }}
table.kv th, table.runs th {{ background: #f6f6f6; font-weight: 600; }} .two {{ display: flex; gap: 24px; flex-wrap: wrap; }}
.glance {{ border-top: none; }} .cards {{ display: flex; gap: 12px; flex-wrap: wrap; margin: 12px 0 4px; }}
.card {{ border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 150px; }}
.card .big {{ font-size: 26px; font-weight: 600; }} .card .what {{ font-size: 13px; }}
.card .detail, .phases .what {{ font-size: 12px; color: #666; }}
.phases {{ margin-top: 10px; }} .phases .bar {{ display: flex; height: 18px; border-radius: 3px; overflow: hidden; margin: 4px 0; }}
.phases .keys {{ font-size: 12px; display: flex; gap: 14px; flex-wrap: wrap; }}
.phases .key i {{ display: inline-block; width: 10px; height: 10px; margin-right: 4px; vertical-align: -1px; }}
#js-errors {{ color: #b00; }}
ul.flags {{ margin: 6px 0; padding-left: 20px; }} li.flag-line.unusable {{ color: #b00; font-weight: 600; }}
table.examples td.answer {{ max-width: 760px; white-space: pre-wrap; word-break: break-word; font-size: 12px; }}
.reasoning {{ color: #666; font-style: italic; margin-bottom: 4px; }} .parse-error {{ color: #b00; }}
</style></head><body>
<h1>{heading}</h1>
{glance}
{runs}
{answers}
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
    Plotly.newPlot(el, figures[key].data, figures[key].layout, {{displaylogo: false, responsive: true, displayModeBar: false}});
    if (el.querySelector(".main-svg")) {{ el.setAttribute("data-rendered", "1"); drawn += 1; }}
  }});
  document.body.setAttribute("data-charts-drawn", String(drawn));
}})();
</script>
</body></html>
"""
