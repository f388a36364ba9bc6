"""The charts of `qbatch report`: Plotly figure dicts built from data.py's aggregates.

Charts over time share one axis (timeline.py): the folder's runs back to back, each shaded and labelled
when there are several. A legend sits above its plot, never over an axis title; a short series shows
each point.
"""

from __future__ import annotations

import html
from typing import Any

MARKERS_BELOW = 60  # a series of fewer points (a short run) shows each point, not a bare line
NO_TELEMETRY = "this folder has no telemetry.parquet (a run before telemetry, or run with --no-telemetry)"
NO_ENGINE = "telemetry.parquet holds no engine counters (the null engine keeps none)"


def _layout(**changes: Any) -> dict[str, Any]:
    """A chart's layout: the legend above the plot, left-aligned (Plotly grows the top margin to fit it), so
    it never covers an axis title (the page shows no mode bar, which would sit on a long legend)."""
    layout = {"margin": {"l": 60, "r": 60, "t": 30, "b": 50}, "height": 320, "template": None, "hovermode": "x unified",
              "legend": {"orientation": "h", "x": 0, "xanchor": "left", "y": 1.02, "yanchor": "bottom"}}
    layout.update(changes)
    return layout


def _time_layout(axis: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A chart over the time axis: its title and unit, each run shaded and labelled when there are several."""
    shapes, annotations = [], []
    for i, run in enumerate(axis["runs"]):
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": run["x0"], "x1": run["x1"], "y0": 0, "y1": 1,
                       "fillcolor": "rgba(76,120,168,0.07)" if i % 2 == 0 else "rgba(245,133,24,0.07)",
                       "line": {"width": 0}, "layer": "below"})
        annotations.append({"xref": "x", "yref": "paper", "x": run["x0"], "y": 1, "xanchor": "left", "yanchor": "top",
                            "text": html.escape(run["label"]), "showarrow": False, "font": {"size": 11, "color": "#444"},
                            "bgcolor": "rgba(255,255,255,0.8)"})
    layout = _layout(shapes=shapes, annotations=annotations)
    layout.update(changes)
    layout["xaxis"] = {"title": {"text": axis["title"]}, "rangemode": "tozero", **changes.get("xaxis", {})}
    return layout


def _right_axis(title: str, **extra: Any) -> dict[str, Any]:
    """A second y axis on the right, over the first: ticks of its own (not those of the left one's, which make
    counts read 4.44, 8.89), no grid of its own."""
    return {"title": {"text": title}, "overlaying": "y", "side": "right", "tickmode": "auto", "showgrid": False,
            **extra}


def _line(name: str, series: dict[str, Any], column: str, **extra: Any) -> dict[str, Any]:
    """A line over the time axis (with a marker at each point for a short series)."""
    mode = "lines+markers" if len(series["x"]) < MARKERS_BELOW else "lines"
    return {"type": "scatter", "mode": mode, "name": name, "x": series["x"], "y": series[column],
            "marker": {"size": 5}, **extra}


def throughput(series: dict[str, Any] | None, axis: dict[str, Any], tokens_of: str) -> dict[str, Any] | None:
    if series is None:
        return None
    column = f"{tokens_of}_tok_s"
    return {"data": [_line(f"{tokens_of} tok/s", series, column),
                     _line("rows/s", series, "rows_s", visible="legendonly"),
                     _line("rows saved (all runs)", series, "rows_saved", yaxis="y2", line={"dash": "dot"})],
            "layout": _time_layout(axis, yaxis={"title": {"text": f"{tokens_of} tok/s"}, "rangemode": "tozero"},
                                   yaxis2=_right_axis("rows saved", rangemode="tozero"))}


def devices(gpus: dict[str, Any] | None, host: dict[str, Any] | None, axis: dict[str, Any]) -> dict[str, Any] | str:
    """GPUs: utilization, memory and power in three panels over one time axis; without: CPU and RSS."""
    if gpus:
        traces = []
        for device, s in gpus.items():
            group = {"legendgroup": device}
            traces.append(_line(f"GPU {device} util %", s, "gpu_util_pct", **group))
            traces.append(_line(f"GPU {device} memory GiB", s, "gpu_mem_used_bytes", yaxis="y2", **group))
            if s["gpu_power_w"] is not None:
                traces.append(_line(f"GPU {device} power W", s, "gpu_power_w", yaxis="y3", **group))
        return {"data": traces, "layout": _time_layout(
            axis, height=560, yaxis={"title": {"text": "utilization %"}, "range": [0, 105], "domain": [0.7, 1]},
            yaxis2={"title": {"text": "memory GiB"}, "rangemode": "tozero", "domain": [0.36, 0.64], "anchor": "x"},
            yaxis3={"title": {"text": "power W"}, "rangemode": "tozero", "domain": [0, 0.3], "anchor": "x"},
            xaxis={"anchor": "y3"})}
    if host is None:
        return NO_TELEMETRY
    return {"data": [_line("CPU % (of one core)", host, "cpu_pct"), _line("RSS GiB", host, "rss_bytes", yaxis="y2")],
            "layout": _time_layout(axis, height=420,
                                   yaxis={"title": {"text": "CPU % of one core"}, "rangemode": "tozero",
                                          "domain": [0.54, 1]},
                                   yaxis2={"title": {"text": "RSS GiB"}, "rangemode": "tozero", "domain": [0, 0.46],
                                           "anchor": "x"}, xaxis={"anchor": "y2"})}


def engines(engines: dict[str, Any] | None, throughput: dict[str, Any] | None,
             axis: dict[str, Any]) -> dict[str, Any] | None:
    if engines is None:
        return None
    traces = []
    for label, s in engines.items():
        for column, name in (("requests_in_engine", "requests in engine"), ("requests_running", "running"),
                             ("requests_waiting", "waiting")):
            if s[column] is not None:
                traces.append(_line(f"{label}: {name}", s, column))
        if s["kv_cache_usage"] is not None:
            traces.append(_line(f"{label}: KV cache %", s, "kv_cache_usage", yaxis="y2", line={"dash": "dot"}))
    if throughput is not None and throughput["prefix_cache_hit_pct"] is not None:
        traces.append(_line("prefix-cache hit %", throughput, "prefix_cache_hit_pct", yaxis="y2",
                            line={"dash": "dash"}))
    return {"data": traces, "layout": _time_layout(axis, yaxis={"title": {"text": "requests"}, "rangemode": "tozero"},
                                                   yaxis2=_right_axis("%", range=[0, 105]))}


def lengths(lengths: dict[str, Any] | None) -> dict[str, Any] | str:
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


def finish(reasons: dict[str, int] | None) -> dict[str, Any] | str:
    if not reasons:
        return "no results yet"
    return {"data": [{"type": "bar", "x": list(reasons), "y": list(reasons.values()), "text": list(reasons.values()),
                      "textposition": "auto"}], "layout": _layout(height=260, hovermode="closest", showlegend=False,
                                                                  yaxis={"title": {"text": "rows"}})}


def chunks(chunks: dict[str, Any] | None) -> dict[str, Any] | str:
    if chunks is None:
        return "no per-chunk timings in stats.json (the run has not finished yet)"
    return {"data": [
        {"type": "bar", "name": "seconds since the previous chunk", "x": chunks["finished_s"], "y": chunks["seconds"],
         "customdata": chunks["index"], "hovertemplate": "chunk %{customdata}: %{y:.2f}s"},
        {"type": "scatter", "mode": "markers", "name": "rows", "x": chunks["finished_s"], "y": chunks["rows"],
         "yaxis": "y2"},
    ], "layout": _layout(hovermode="closest", xaxis={"title": {"text": "finished at (s after generation began)"},
                                                     "rangemode": "tozero"},
                         yaxis={"title": {"text": "seconds"}}, yaxis2=_right_axis("rows", rangemode="tozero"))}


