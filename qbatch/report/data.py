"""What `qbatch report` shows, computed from an output folder's files: small aggregates, never rows.

Every section reads one file (telemetry, stats.json, manifest.json, the results and errors) and
returns plain lists and numbers, or None when that file was not recorded (an output folder
older than telemetry, a run still in progress). The results are read with polars, only the
columns a chart needs: a million-row results.parquet becomes a few hundred numbers.

Telemetry is sampled while a run generates (jobs/opening.py starts it when the engine is ready and
stops it when the last chunk is written), so a run's samples are its generation. A folder holds
the runs of one job (a first run, then resumes: manifest.json's `runs`); their samples are split by
run and drawn back to back on one axis of time spent generating, each run labelled (timeline.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qbatch._fs import read_json
from qbatch.output.folder import OutputDir
from qbatch.output.telemetry import read as read_telemetry
from qbatch.report.timeline import Timeline

NUM_BINS = 40  # per length histogram
NUM_ERROR_EXAMPLES = 3
COUNTERS = ("generation_tokens", "finished_requests", "prompt_tokens", "cached_tokens")  # cumulative, per engine


def collect(output_dir: str | Path) -> dict[str, Any]:
    """Every section's data; None for what the folder does not hold."""
    folder = Path(output_dir)
    manifest = read_json(folder / "manifest.json") or {}
    stats = read_json(folder / "stats.json") or {}
    telemetry = read_telemetry(folder)
    timeline = Timeline.of(manifest, telemetry, live=OutputDir(folder).lock_holder() is not None)
    embeds = (manifest.get("spec") or {}).get("task") == "embed"
    for run in timeline.drawn():
        run.update(run_numbers(timeline, run, embeds=embeds))
    return {
        "output_dir": str(folder.resolve()),
        "manifest": manifest,
        "stats": stats,
        "telemetry_recorded": telemetry is not None,
        "axis": timeline.axis(),
        "runs": timeline.runs,
        "glance": glance(manifest, stats, timeline),
        "throughput": throughput(timeline),
        "devices": devices(timeline),
        "host": host(timeline),
        "engines": engines(timeline),
        "lengths": lengths(folder),
        "finish_reasons": finish_reasons(folder),
        "errors": errors(folder),
        "chunks": chunks(stats),
    }


def _with_rates(rows: Any) -> Any:
    """Engine rows with their cumulative counters turned into increments since the engine's previous
    sample of the same run; null at a run's first sample, which has no earlier one (an engine that was up
    before the run counts from its own start, not the run's)."""
    import polars as pl

    return rows.sort("time").with_columns([pl.col(c).diff().over("run", "device").clip(lower_bound=0)
                                           for c in COUNTERS])


def throughput(timeline: Timeline) -> dict[str, Any] | None:
    """Output tok/s and rows/s over time, from the engines' counters (summed over engines), and the rows
    saved so far (written to parts, all runs): a rate of rows that finish a few at a time jumps, their
    count climbs, so a short run reads from it. Rows an interrupted run had finished but not written are
    not saved: the next run redoes them."""
    import polars as pl

    if timeline.rows("engine") is None:
        return None
    rows = timeline.frame.filter(pl.col("source").is_in(["engine", "run"]))
    every = timeline.bucket_s
    series = timeline.buckets(_with_rates(rows), [
        *(pl.when(pl.col(c).is_not_null().any()).then(pl.col(c).sum()).alias(c) for c in COUNTERS),
        pl.col("rows_done").max()])
    before = (series.group_by("run").agg(pl.col("rows_done").max().fill_null(0)).sort("run")
              .with_columns(pl.col("rows_done").cum_sum().shift(1, fill_value=0).alias("saved_before")))
    series = series.join(before.select("run", "saved_before"), on="run").sort("x").with_columns(
        (pl.col("generation_tokens") / every).round(1).alias("output_tok_s"),
        (pl.col("prompt_tokens") / every).round(1).alias("input_tok_s"),
        (pl.col("finished_requests") / every).round(2).alias("rows_s"),
        pl.when(pl.col("prompt_tokens") > 0).then((100 * pl.col("cached_tokens") / pl.col("prompt_tokens")).round(1))
        .alias("prefix_cache_hit_pct"),
        (pl.col("saved_before") + pl.col("rows_done").forward_fill().over("run").fill_null(0)).alias("rows_saved"))
    return timeline.series(series, ["output_tok_s", "input_tok_s", "rows_s", "prefix_cache_hit_pct", "rows_saved"])


def devices(timeline: Timeline) -> dict[str, Any] | None:
    """Per GPU: utilization %, memory used (GiB) and power (W) over time."""
    rows = timeline.rows("gpu")
    if rows is None:
        return None
    return {device: _means(timeline, part, {"gpu_util_pct": 1, "gpu_mem_used_bytes": 1 / 2**30, "gpu_power_w": 1})
            for device, part in _by_device(rows)}


def host(timeline: Timeline) -> dict[str, Any] | None:
    """This process tree's CPU % and RSS (GiB) over time."""
    rows = timeline.rows("host")
    if rows is None:
        return None
    return _means(timeline, rows, {"cpu_pct": 1, "rss_bytes": 1 / 2**30})


def engines(timeline: Timeline) -> dict[str, Any] | None:
    """Per engine: requests in it (running / waiting with --enable-log-stats) and KV-cache usage %."""
    rows = timeline.rows("engine")
    if rows is None:
        return None
    return {device: _means(timeline, part, {"requests_in_engine": 1, "requests_running": 1, "requests_waiting": 1,
                                            "kv_cache_usage": 100})
            for device, part in _by_device(rows)}


def _by_device(rows: Any) -> list[tuple[str, Any]]:
    return [(str(key[0]), part) for key, part in sorted(rows.group_by("device"), key=lambda kv: str(kv[0][0]))]


def _means(timeline: Timeline, rows: Any, columns: dict[str, float]) -> dict[str, Any]:
    """Bucket means of the columns, scaled; a column with no value at all is None."""
    import polars as pl

    series = timeline.buckets(rows, [(pl.col(c).cast(pl.Float64).mean() * scale).round(3).alias(c)
                                     for c, scale in columns.items()])
    return timeline.series(series, list(columns))


# -- the header --------------------------------------------------------------
def run_numbers(timeline: Timeline, run: dict[str, Any], *, embeds: bool) -> dict[str, Any]:
    """One run's generation, from its samples: tok/s (the engines' counters: output tokens, or input
    tokens for embeddings), mean GPU utilization (over its GPUs and time), mean power per GPU and the
    energy of all GPUs, peak GPU memory, mean CPU % and peak RSS. None for what was not recorded."""
    import polars as pl

    seconds = run["seconds"] or 0.0
    out: dict[str, Any] = {"tok_s": None, "gpus": 0, "gpu_util_pct": None, "cpu_pct": None}
    engine = timeline.rows("engine", run=run["index"])
    if engine is not None and seconds > 0:
        tokens = _with_rates(engine).get_column("prompt_tokens" if embeds else "generation_tokens").sum()
        out["tok_s"] = round(tokens / seconds, 1)
    gpu = timeline.rows("gpu", run=run["index"])
    if gpu is not None:
        per_gpu = gpu.group_by("device").agg(
            pl.col("gpu_util_pct").mean(), pl.col("gpu_power_w").mean(), pl.col("gpu_mem_used_bytes").max(),
            pl.col("gpu_mem_total_bytes").max()).sort("device")
        out["gpus"] = per_gpu.height
        out["gpu_util_pct"] = _round(per_gpu["gpu_util_pct"].mean(), 1)
        out["gpu_util_by_gpu"] = {str(d): _round(u, 1) for d, u in zip(per_gpu["device"], per_gpu["gpu_util_pct"])}
        power = per_gpu["gpu_power_w"].drop_nulls()
        if power.len():
            out["gpu_power_w"] = _round(power.mean(), 1)
            out["gpu_energy_wh"] = _round(power.sum() * seconds / 3600, 2)
        out["gpu_mem_peak_gib"] = _round(_max_or_none(per_gpu["gpu_mem_used_bytes"]), 1, 1 / 2**30)
        out["gpu_mem_total_gib"] = _round(_max_or_none(per_gpu["gpu_mem_total_bytes"]), 1, 1 / 2**30)
    host_rows = timeline.rows("host", run=run["index"])
    if host_rows is not None:
        out["cpu_pct"] = _round(host_rows["cpu_pct"].mean(), 0)
        out["rss_peak_gib"] = _round(_max_or_none(host_rows["rss_bytes"]), 1, 1 / 2**30)
    return out


def glance(manifest: dict[str, Any], stats: dict[str, Any], timeline: Timeline) -> dict[str, Any]:
    """What someone who judges a deployment by nvidia-smi looks for first, for one run (the last that
    generated): mean GPU (or CPU) utilization while it generated, output tok/s (per GPU too), GPU
    power and energy, peak GPU memory; and the phase split of stats.json (the last completed run).

    tok/s is stats.json's (what the run printed) when stats.json is that run's, else the engines'
    counters over its samples (`tok_s_source` says which).
    """
    embeds = (manifest.get("spec") or {}).get("task") == "embed"
    run = timeline.last_run()
    out: dict[str, Any] = {"run": None, "runs": len(timeline.runs), "tokens_of": "input" if embeds else "output",
                           "generate_s": None, "tok_s": None, "tok_s_source": None, "gpus": 0}
    if run is not None:
        out.update(run_numbers(timeline, run, embeds=embeds), run=run["label"], generate_s=run["seconds"])
        out["tok_s_source"] = "telemetry" if out["tok_s"] is not None else None
    if _stats_are_of(stats, manifest, run):
        tokens = stats.get("prompt_tokens" if embeds else "completion_tokens") or 0
        out.update(tok_s=round(tokens / stats["generate_s"], 1), tok_s_source="stats.json",
                   generate_s=round(stats["generate_s"], 1))
    if out["tok_s"] is not None and out["gpus"]:
        out["tok_s_per_gpu"] = round(out["tok_s"] / out["gpus"], 1)
    out["phases"] = phase_split(stats)
    return out


def _stats_are_of(stats: dict[str, Any], manifest: dict[str, Any], run: dict[str, Any] | None) -> bool:
    """Whether stats.json (written when a run completes) is this run's: the folder's last run, which completed
    and generated. A run that found nothing to do writes a stats.json without generation; one that stopped
    writes none, leaving an earlier run's."""
    if not stats.get("generate_s"):
        return False
    if run is None:  # no telemetry: stats.json is all there is
        return manifest.get("status") == "completed"
    return run["is_last"] and run["status"] == "completed"


def _round(value: Any, digits: int, scale: float = 1.0) -> float | None:
    return None if value is None else round(float(value) * scale, digits)


def _max_or_none(series: Any) -> Any:
    series = series.drop_nulls()
    return series.max() if series.len() else None


def phase_split(stats: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The last completed run's wall time split into what it waited on, in order: setup (inputs, tokenizer,
    the pre-scan), the engine's start beyond the setup (engines start early, beside the setup: only the
    wait left after it counts), generation, and assembly. The parts add up to the wall time. None when
    that run generated nothing (a rerun that found every row done)."""
    if not stats or not stats.get("wall_s") or not stats.get("generate_s"):
        return None
    wall = float(stats["wall_s"])
    setup, generate, assemble = (float(stats.get(k) or 0.0) for k in ("setup_s", "generate_s", "assemble_s"))
    waited = max(0.0, min(float(stats.get("engine_start_s") or 0.0), wall - setup - generate - assemble))
    parts = [("setup", setup), ("engine start", waited), ("generate", generate), ("assembly", assemble)]
    other = wall - sum(seconds for _, seconds in parts)
    if other > 0.05 * wall:  # time the phases above do not cover (writing stats, the run's own overhead)
        parts.append(("other", other))
    return [{"name": name, "seconds": round(seconds, 2), "share": round(seconds / wall, 4)}
            for name, seconds in parts if seconds > 0] + [{"name": "wall", "seconds": round(wall, 2), "share": 1.0}]


# -- stats.json and the results ------------------------------------------------
def chunks(stats: dict[str, Any]) -> dict[str, Any] | None:
    """Per chunk: rows, output tokens, and seconds since the previous chunk finished (stats.json)."""
    items = [c for c in (stats or {}).get("chunks") or [] if c.get("finished_s") is not None]
    if not items:
        return None
    items.sort(key=lambda c: c["finished_s"])
    previous, gaps = 0.0, []
    for c in items:
        gaps.append(round(c["finished_s"] - previous, 3))
        previous = c["finished_s"]
    return {"index": [c["index"] for c in items], "finished_s": [c["finished_s"] for c in items],
            "seconds": gaps, "rows": [c["rows"] for c in items],
            "completion_tokens": [c.get("completion_tokens", 0) for c in items]}


def _scan(folder: Path, final: str, prefix: str) -> Any:
    """The rows of results.parquet / errors.parquet, or of the parts while a run has not assembled them."""
    import polars as pl

    path = folder / final
    if path.exists():
        return pl.scan_parquet(path)
    parts = sorted((folder / "parts").glob(f"{prefix}*.parquet"))
    parts = [p for p in parts if ".tmp-" not in p.name]
    return pl.scan_parquet(parts) if parts else None


def lengths(folder: Path) -> dict[str, Any] | None:
    """Histograms of prompt and output lengths (tokens) of the results."""
    import polars as pl

    results = _scan(folder, "results.parquet", "part-")
    if results is None:
        return None
    columns = [c for c in ("prompt_tokens", "completion_tokens") if c in results.collect_schema().names()]
    if not columns:
        return None
    frame = results.select(columns).collect()
    out: dict[str, Any] = {"rows": frame.height}
    for column in columns:
        values = frame.get_column(column).drop_nulls()
        if values.len() == 0:
            out[column] = None
            continue
        top = int(values.max())
        width = max(1, -(-(top + 1) // NUM_BINS))
        counts = (values.to_frame().with_columns((pl.col(column) // width * width).alias("bin"))
                  .group_by("bin").len().sort("bin"))
        out[column] = {"bin": counts["bin"].to_list(), "count": counts["len"].to_list(), "width": width,
                       "mean": round(float(values.mean()), 1), "max": top}
    return out


def finish_reasons(folder: Path) -> dict[str, int] | None:
    results = _scan(folder, "results.parquet", "part-")
    if results is None or "finish_reason" not in results.collect_schema().names():
        return None
    counts = results.group_by("finish_reason").len().collect().sort("len", descending=True)
    return {str(reason): int(n) for reason, n in counts.iter_rows()}


def errors(folder: Path) -> list[dict[str, Any]] | None:
    """Error kinds, how many rows each, and a few example rows (id and message). [] when no row failed."""
    import polars as pl

    scan = _scan(folder, "errors.parquet", "errors-")
    if scan is None:
        return [] if (folder / "results.parquet").exists() else None
    frame = scan.select("id", "error", "message").collect()
    kinds = []
    for (kind,), part in sorted(frame.group_by("error"), key=lambda kv: -kv[1].height):
        examples = part.head(NUM_ERROR_EXAMPLES).select(pl.col("id"), pl.col("message")).to_dicts()
        kinds.append({"error": str(kind), "rows": part.height, "examples": examples})
    return kinds
