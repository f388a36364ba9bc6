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

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from qbatch.output.folder import OutputDir
from qbatch.output.manifest import Manifest
from qbatch.output.reading import FINAL_HINT, PART_HINT, reading
from qbatch.output.summary import Summary
from qbatch.output.telemetry import read as read_telemetry
from qbatch.report.answers import summarize as summarize_answers
from qbatch.report.glance import glance, run_numbers
from qbatch.report.timeline import COUNTERS, Timeline, increments

T = TypeVar("T")
NUM_BINS = 40  # per length histogram
NUM_ERROR_EXAMPLES = 3
# Engines count a row's tokens when the row finishes, so a rate over one second shows when rows finished
# (a short job's whole output in its last second: 20x its throughput), not how fast tokens came. A rate is
# over the last RATE_WINDOW_S seconds, or the run's whole length when it is shorter.
RATE_WINDOW_S = 10


def collect(output_dir: str | Path) -> dict[str, Any]:
    """Every section's data; None for what the folder does not hold."""
    folder = Path(output_dir)
    manifest = Manifest.read(folder / "manifest.json") or Manifest()
    stats = Summary.read(folder / "stats.json")
    telemetry = read_telemetry(folder)
    timeline = Timeline.of(manifest, telemetry, live=OutputDir(folder).lock_holder() is not None)
    embeds = manifest.task == "embed"
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
        "answers": _query(folder, "results.parquet", "part-", summarize_answers),
        "adapters": adapters(folder),
        "errors": errors(folder),
        "chunks": chunks(stats),
    }


def throughput(timeline: Timeline) -> dict[str, Any] | None:
    """Output tok/s and rows/s over time, from the engines' counters (summed over engines) over a trailing
    window (RATE_WINDOW_S, or the run's length), and the rows saved so far (written to parts, all runs): a
    rate of rows that finish a few at a time jumps, their count climbs, so a short run reads from it. Rows
    an interrupted run had finished but not written are not saved: the next run redoes them."""
    import polars as pl

    if timeline.rows("engine") is None:
        return None
    rows = timeline.frame.filter(pl.col("source").is_in(["engine", "run"]))
    series = _windowed(timeline, timeline.buckets(increments(rows), [
        *(pl.when(pl.col(c).is_not_null().any()).then(pl.col(c).sum()).alias(c) for c in COUNTERS),
        pl.col("rows_done").max()]))
    before = (series.group_by("run").agg(pl.col("rows_done").max().fill_null(0)).sort("run")
              .with_columns(pl.col("rows_done").cum_sum().shift(1, fill_value=0).alias("saved_before")))
    series = series.join(before.select("run", "saved_before"), on="run").sort("x").with_columns(
        (pl.col("generation_tokens") / pl.col("window_s")).round(1).alias("output_tok_s"),
        (pl.col("prompt_tokens") / pl.col("window_s")).round(1).alias("input_tok_s"),
        (pl.col("finished_requests") / pl.col("window_s")).round(2).alias("rows_s"),
        pl.when(pl.col("prompt_tokens") > 0).then((100 * pl.col("cached_tokens") / pl.col("prompt_tokens")).round(1))
        .alias("prefix_cache_hit_pct"),
        (pl.col("saved_before") + pl.col("rows_done").forward_fill().over("run").fill_null(0)).alias("rows_saved"))
    return timeline.series(series, ["output_tok_s", "input_tok_s", "rows_s", "prefix_cache_hit_pct", "rows_saved"])


def _windowed(timeline: Timeline, series: Any) -> Any:
    """Each bucket's counters summed over the trailing window that ends with it (within its run), and the
    window's seconds (`window_s`): RATE_WINDOW_S, or the run's length when shorter, never below a bucket."""
    import polars as pl

    seconds = {run["index"]: run["seconds"] or 0.0 for run in timeline.drawn()}
    parts = []
    for (run,), part in series.group_by("run"):
        window = max(float(timeline.bucket_s), min(float(RATE_WINDOW_S), seconds.get(run, 0.0)))
        size = f"{round(window * 1e6)}us"
        parts.append(part.sort("time").with_columns(
            *(pl.when(pl.col(c).is_not_null().any()).then(pl.col(c).fill_null(0).rolling_sum_by("time", size))
              .alias(c) for c in COUNTERS), pl.lit(window).alias("window_s")))
    return pl.concat(parts).sort("x") if parts else series.with_columns(pl.lit(1.0).alias("window_s"))


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


# -- stats.json and the results ------------------------------------------------
def chunks(stats: Summary | None) -> dict[str, Any] | None:
    """Per chunk: rows, output tokens, and seconds since the previous chunk finished (stats.json)."""
    items = [c for c in (stats.chunks if stats else []) if c.get("finished_s") is not None]
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


def _query(folder: Path, final: str, prefix: str, query: Callable[[Any], T]) -> T | None:
    """`query` on the rows of results.parquet / errors.parquet (a LazyFrame), or of the parts while a run
    has not assembled them; None when there are none. A file that cannot be read is an OutputError."""
    import polars as pl

    path = folder / final
    if path.exists():
        with reading(path, FINAL_HINT):
            return query(pl.scan_parquet(path))
    parts = sorted((folder / "parts").glob(f"{prefix}*.parquet"))
    parts = [p for p in parts if ".tmp-" not in p.name]
    if not parts:
        return None
    with reading(folder / "parts", PART_HINT):
        return query(pl.scan_parquet(parts))


def lengths(folder: Path) -> dict[str, Any] | None:
    """Histograms of prompt and output lengths (tokens) of the results."""
    def token_counts(results: Any) -> Any:
        columns = [c for c in ("prompt_tokens", "completion_tokens") if c in results.collect_schema().names()]
        return results.select(columns).collect() if columns else None

    frame = _query(folder, "results.parquet", "part-", token_counts)
    return None if frame is None else _histograms(frame)


def _histograms(frame: Any) -> dict[str, Any]:
    import polars as pl

    out: dict[str, Any] = {"rows": frame.height}
    for column in frame.columns:
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
    def count(results: Any) -> Any:
        if "finish_reason" not in results.collect_schema().names():
            return None
        return results.group_by("finish_reason").len().collect().sort("len", descending=True)

    counts = _query(folder, "results.parquet", "part-", count)
    return None if counts is None else {str(reason): int(n) for reason, n in counts.iter_rows()}


def adapters(folder: Path) -> list[dict[str, Any]] | None:
    """Per LoRA adapter (null: the base model), its result rows and tokens; None for jobs without adapters."""
    import polars as pl

    def count(results: Any) -> Any:
        if "adapter" not in results.collect_schema().names():
            return None
        return (results.group_by("adapter").agg(pl.len().alias("rows"), pl.col("prompt_tokens").sum(),
                                                pl.col("completion_tokens").sum())
                .collect().sort("adapter", nulls_last=False))

    frame = _query(folder, "results.parquet", "part-", count)
    return None if frame is None else frame.to_dicts()


def errors(folder: Path) -> list[dict[str, Any]] | None:
    """Error kinds, how many rows each, and a few example rows (id and message). [] when no row failed."""
    import polars as pl

    frame = _query(folder, "errors.parquet", "errors-", lambda scan: scan.select("id", "error", "message").collect())
    if frame is None:
        return [] if (folder / "results.parquet").exists() else None
    kinds = []
    for (kind,), part in sorted(frame.group_by("error"), key=lambda kv: -kv[1].height):
        examples = part.head(NUM_ERROR_EXAMPLES).select(pl.col("id"), pl.col("message")).to_dicts()
        kinds.append({"error": str(kind), "rows": part.height, "examples": examples})
    return kinds
