"""What `qbatch report` shows, computed from an output folder's files: small aggregates, never rows.

Every section reads one file (telemetry, stats.json, manifest.json, the results and errors) and
returns plain lists and numbers, or None when that file was not recorded (an output folder
older than telemetry, a run still in progress). The results are read with polars, only the
columns a chart needs: a million-row results.parquet becomes a few hundred numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from qbatch.output.reading import FINAL_HINT, PART_HINT, read_manifest, read_stats, reading
from qbatch.output.telemetry import read as read_telemetry

T = TypeVar("T")
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
GAP_BUCKETS = 5  # no sample for this many buckets: two runs, not one (the line breaks)
MAX_POINTS = 600  # per time series: a day-long run is drawn from 600 buckets, not 86,400 samples
NUM_BINS = 40  # per length histogram
NUM_ERROR_EXAMPLES = 3


def collect(output_dir: str | Path) -> dict[str, Any]:
    """Every section's data; None for what the folder does not hold."""
    folder = Path(output_dir)
    manifest = read_manifest(folder / "manifest.json") or {}
    stats = read_stats(folder / "stats.json") or {}
    telemetry = read_telemetry(folder)
    return {
        "output_dir": str(folder.resolve()),
        "manifest": manifest,
        "stats": stats,
        "telemetry_recorded": telemetry is not None,
        "throughput": throughput(telemetry),
        "devices": devices(telemetry),
        "host": host(telemetry),
        "engines": engines(telemetry),
        "phases": phases(stats),
        "lengths": lengths(folder),
        "finish_reasons": finish_reasons(folder),
        "errors": errors(folder),
        "chunks": chunks(stats),
    }


def _bucket_s(frame: Any) -> int:
    """Seconds per point so that a series has at most MAX_POINTS points."""
    span = (frame.get_column("time").max() - frame.get_column("time").min()).total_seconds()
    return max(1, int(span // MAX_POINTS) + 1)


def _rows(frame: Any, source: str) -> Any:
    import polars as pl

    if frame is None:
        return None
    rows = frame.filter(pl.col("source") == source)
    return rows if rows.height else None


def throughput(frame: Any) -> dict[str, Any] | None:
    """Output tok/s and rows/s over time, from the engines' counters (summed over engines)."""
    import polars as pl

    rows = _rows(frame, "engine")
    if rows is None:
        return None
    every = _bucket_s(rows)
    per_engine = (rows.sort("time")
                  .with_columns([pl.col(c).diff().over("device").clip(lower_bound=0).fill_null(0).alias(c)
                                 for c in ("generation_tokens", "finished_requests", "prompt_tokens", "cached_tokens")]))
    series = (per_engine.group_by_dynamic("time", every=f"{every}s")
              .agg(pl.col("generation_tokens").sum(), pl.col("finished_requests").sum(),
                   pl.col("prompt_tokens").sum(), pl.col("cached_tokens").sum())
              .sort("time"))
    hit = [None if p == 0 else round(100 * c / p, 1)
           for p, c in zip(series["prompt_tokens"], series["cached_tokens"], strict=True)]
    return _break_gaps({"time": _times(series), "output_tok_s": [round(v / every, 1) for v in series["generation_tokens"]],
                        "rows_s": [round(v / every, 2) for v in series["finished_requests"]],
                        "prefix_cache_hit_pct": hit}, every)


def devices(frame: Any) -> dict[str, Any] | None:
    """Per GPU: utilization %, memory used (GiB) and power (W) over time."""
    rows = _rows(frame, "gpu")
    if rows is None:
        return None
    return {device: _series(part, {"gpu_util_pct": 1, "gpu_mem_used_bytes": 1 / 2**30, "gpu_power_w": 1})
            for device, part in _by_device(rows)}


def host(frame: Any) -> dict[str, Any] | None:
    """This process tree's CPU % and RSS (GiB) over time."""
    rows = _rows(frame, "host")
    if rows is None:
        return None
    return _series(rows, {"cpu_pct": 1, "rss_bytes": 1 / 2**30})


def engines(frame: Any) -> dict[str, Any] | None:
    """Per engine: requests in it (running / waiting with --enable-log-stats) and KV-cache usage %."""
    rows = _rows(frame, "engine")
    if rows is None:
        return None
    return {device: _series(part, {"requests_in_engine": 1, "requests_running": 1, "requests_waiting": 1,
                                   "kv_cache_usage": 100})
            for device, part in _by_device(rows)}


def _by_device(rows: Any) -> list[tuple[str, Any]]:
    return [(str(key[0]), part) for key, part in sorted(rows.group_by("device"), key=lambda kv: str(kv[0][0]))]


def _series(rows: Any, columns: dict[str, float]) -> dict[str, Any]:
    """Bucket means of the columns (scaled), over time; a column with no value at all is None."""
    import polars as pl

    every = _bucket_s(rows)
    series = rows.sort("time").group_by_dynamic("time", every=f"{every}s").agg(
        [pl.col(c).cast(pl.Float64).mean() for c in columns]).sort("time")
    out: dict[str, Any] = {"time": _times(series)}
    for column, scale in columns.items():
        values = series.get_column(column)
        out[column] = None if values.null_count() == len(values) else [
            None if v is None else round(v * scale, 3) for v in values]
    return _break_gaps(out, every)


def _break_gaps(series: dict[str, Any], every: int) -> dict[str, Any]:
    """A point of nulls where no sample came for GAP_BUCKETS buckets (between two runs of a resumed
    job): the chart breaks its line there instead of drawing one across the gap."""
    from datetime import datetime, timedelta

    times = [datetime.strptime(t, TIME_FORMAT) for t in series["time"]]
    gaps = [i for i in range(1, len(times)) if (times[i] - times[i - 1]).total_seconds() > GAP_BUCKETS * every]
    if not gaps:
        return series
    out: dict[str, Any] = {key: None if values is None else [] for key, values in series.items()}
    previous = 0
    for i in [*gaps, len(times)]:
        for key, values in series.items():
            if values is not None:
                out[key].extend(values[previous:i])
        if i < len(times):
            for key, values in series.items():
                if values is not None:
                    out[key].append((times[i - 1] + timedelta(seconds=every)).strftime(TIME_FORMAT)
                                    if key == "time" else None)
        previous = i
    return out


def _times(series: Any) -> list[str]:
    return [t.strftime(TIME_FORMAT) for t in series.get_column("time")]


def phases(stats: dict[str, Any]) -> dict[str, float] | None:
    """Seconds in setup / engine start / generate / assembly, and the wall time (stats.json)."""
    if not stats or "wall_s" not in stats:
        return None
    return {name: round(float(stats.get(key) or 0.0), 2) for name, key in
            (("setup", "setup_s"), ("engine start", "engine_start_s"), ("generate", "generate_s"),
             ("assembly", "assemble_s"), ("wall", "wall_s"))}


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
