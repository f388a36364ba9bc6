"""OUT_DIR/telemetry.parquet: its columns, its parts, and how it stays bounded.

The sampler (jobs/telemetry.py) writes OUT_DIR/telemetry/part-NNNNNN.parquet every few seconds
(atomic, like the results' parts); they are compacted into telemetry.parquet every COMPACT_PARTS
parts and at the end of a run. The file stays bounded: past MAX_ROWS, the samples older than
KEEP_RECENT_S are thinned to every other one, again at each compaction that finds it too big,
so old hours end up sparse and the last hour stays whole (the engine counters are cumulative:
rates over the gaps stay right).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qbatch._fs import TMP_MARK, atomic_write
from qbatch.errors import OutputError
from qbatch.output.reading import TELEMETRY_HINT, reading

COMPACT_PARTS = 20
MAX_ROWS = 250_000  # ~10 MB of Parquet; a day at 1 Hz with one GPU and two engines is ~350k rows
KEEP_RECENT_S = 3600.0
TELEMETRY_FILE, TELEMETRY_PARTS, PART_PREFIX = "telemetry.parquet", "telemetry", "part-"

# The columns of telemetry.parquet; one row per source per sample, null where a column does not apply.
COLUMNS: dict[str, str] = {
    "time": "timestamp",  # UTC, when the sample was taken
    "source": "str",  # run | host | gpu | engine
    "device": "str",  # gpu: its NVML index; engine: the engine's label; run/host: ""
    "rows_done": "int",  # run: rows finished this run (results and errors), as written to parts
    "output_tokens": "int",  # run: output tokens of the rows written
    "rows_total": "int",  # run: rows this run has to process
    "cpu_pct": "float",  # host: this process and its children, % of one core
    "rss_bytes": "int",  # host: resident memory of this process and its children
    "gpu_util_pct": "float",
    "gpu_mem_used_bytes": "int",
    "gpu_mem_total_bytes": "int",
    "gpu_power_w": "float",
    "requests_in_engine": "int",  # engine: requests qbatch has added and not yet got back
    "requests_running": "int",  # engine, --enable-log-stats: vLLM's scheduler stats
    "requests_waiting": "int",
    "kv_cache_usage": "float",  # 0..1
    "finished_requests": "int",  # engine counters since it started (cumulative)
    "prompt_tokens": "int",
    "cached_tokens": "int",  # prefix-cache hits among prompt_tokens
    "generation_tokens": "int",
}


def schema() -> Any:
    import pyarrow as pa

    types = {"timestamp": pa.timestamp("us", tz="UTC"), "str": pa.string(), "int": pa.int64(), "float": pa.float64()}
    return pa.schema([(name, types[kind]) for name, kind in COLUMNS.items()])


def write_part(folder: Path, rows: list[dict[str, Any]]) -> Path:
    """Rows (dicts of COLUMNS) as the next telemetry part."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=schema())
    parts = Path(folder) / TELEMETRY_PARTS
    parts.mkdir(exist_ok=True)
    existing = part_files(folder)
    number = int(existing[-1].stem.removeprefix(PART_PREFIX)) + 1 if existing else 1
    path = parts / f"{PART_PREFIX}{number:06d}.parquet"
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))
    return path


def part_files(folder: Path) -> list[Path]:
    parts = Path(folder) / TELEMETRY_PARTS
    if not parts.is_dir():
        return []
    return sorted(p for p in parts.iterdir() if p.name.startswith(PART_PREFIX) and p.suffix == ".parquet"
                  and TMP_MARK not in p.name)


def read(folder: str | Path, *, skip_damaged: bool = False) -> Any:
    """Every telemetry row of an output folder (the compacted file and the parts of a live run), by time;
    None when none was recorded. A file there that cannot be read is an OutputError naming it, or with
    `skip_damaged` (a run compacting its own telemetry, which then replaces it) left out."""
    import polars as pl

    folder = Path(folder)
    files = [p for p in [folder / TELEMETRY_FILE, *part_files(folder)] if p.exists()]
    frames = []
    for path in files:
        try:
            with reading(path, TELEMETRY_HINT):
                frame = pl.read_parquet(path)
                missing = [name for name in ("time", "source", "device") if name not in frame.columns]
                if missing:
                    raise OutputError(f"{path.name} is not qbatch telemetry: no column {', '.join(missing)}",
                                      where=str(path), hint=TELEMETRY_HINT)
        except OutputError:
            if skip_damaged or not path.exists():  # damaged, or a part a compaction removed meanwhile
                continue
            raise
        frames.append(frame)
    if not frames:
        return None
    return pl.concat(frames, how="diagonal_relaxed").unique(["time", "source", "device"]).sort("time")


def compact(folder: str | Path, *, max_rows: int = MAX_ROWS, keep_recent_s: float = KEEP_RECENT_S) -> None:
    """telemetry.parquet := itself + the parts, thinned to max_rows; then the parts go (a crash between
    the two leaves rows twice, which read() and the next compaction drop)."""
    import pyarrow.parquet as pq

    folder = Path(folder)
    parts = part_files(folder)
    if not parts:
        return
    frame = read(folder, skip_damaged=True)
    if frame is None:
        return
    frame = thin(frame, max_rows=max_rows, keep_recent_s=keep_recent_s)
    table = frame.to_arrow().cast(schema())
    atomic_write(folder / TELEMETRY_FILE, lambda tmp: pq.write_table(table, tmp, compression="zstd"))
    for part in parts:
        part.unlink(missing_ok=True)


def thin(frame: Any, *, max_rows: int, keep_recent_s: float) -> Any:
    """Halve the sample rate of everything older than keep_recent_s until the frame fits max_rows
    (then the recent part too, if it alone is over)."""
    from datetime import timedelta

    import polars as pl

    while frame.height > max_rows:
        times = frame.get_column("time").unique().sort()
        old = times.filter(times < times[-1] - timedelta(seconds=keep_recent_s))
        if old.len() < 2:
            old = times  # the recent hour alone is over the cap: thin it too
        dropped = old.gather(list(range(1, old.len(), 2)))
        before = frame.height
        frame = frame.filter(~pl.col("time").is_in(dropped.implode()))
        if frame.height == before:
            break
    return frame
