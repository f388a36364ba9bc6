"""A folder's runs on one time axis: telemetry samples split by run, drawn back to back.

An output folder holds the runs of one job: a first run, then reruns that resume it (manifest.json's
`runs`, each with when it started and how it ended). Telemetry is sampled while a run generates, so
between two runs lies a gap of minutes or days. The report draws each run's samples from its own start,
one run after the other with a small space between them, on an axis of time spent generating, and
labels each run (`run 2 (resumed): completed`): no unmarked gap, no line drawn across it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from qbatch.output.manifest import Manifest, RunRecord

MAX_POINTS = 600  # per series: a day-long run is drawn from 600 buckets, not 86,400 samples
GAP_BUCKETS = 5  # no sample for this many buckets inside a run: the line breaks there
RUN_SPACE = 0.015  # the space between two runs on the axis, as a share of the axis
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
COUNTERS = ("generation_tokens", "finished_requests", "prompt_tokens", "cached_tokens")  # cumulative, per engine
# The axis' unit by the time drawn: seconds for short runs (a run of a few seconds reads 0-5 s)
UNITS = ((600, "s", 1), (36_000, "min", 60), (float("inf"), "h", 3600))


@dataclass
class Timeline:
    """Telemetry rows with the run each belongs to (`run`: an index into `runs`), and the runs."""

    frame: Any  # polars DataFrame of telemetry rows plus `run`, or None
    runs: list[dict[str, Any]]  # every run the manifest lists (or one unnamed run), in order
    bucket_s: int  # seconds per point of a series
    unit: tuple[str, int]  # the axis' unit and its seconds

    @classmethod
    def of(cls, manifest: Manifest, telemetry: Any, *, live: bool) -> Timeline:
        """The runs of `manifest` (labelled by how each ended; `live`: a run holds the folder now) and the
        telemetry rows split among them by their start times."""
        import polars as pl

        records: list[RunRecord | None] = [*manifest.runs] or [None]  # None: a run the manifest does not list
        runs = [_describe(record, i, len(records), manifest.status, live) for i, record in enumerate(records)]
        if telemetry is None or telemetry.height == 0:
            return cls(None, runs, 1, ("s", 1))
        starts = [_parse(record.started_at if record else None) for record in records]
        earlier = (pl.col("time") < starts[0]) if starts[0] is not None else pl.lit(False)
        index = pl.sum_horizontal([pl.lit(1) if s is None else (pl.col("time") >= s).cast(pl.Int32) for s in starts]) - 1
        frame = telemetry.with_columns(pl.when(earlier).then(-1).otherwise(index).alias("run"))
        if frame.filter(pl.col("run") == -1).height:  # runs the manifest no longer lists (it keeps the last 20)
            runs.insert(0, {"index": -1, "name": "earlier runs", "status": "not listed in manifest.json",
                            "resumed": False, "label": "earlier runs", "is_last": False, "started_at": None,
                            "ended_at": None, "rows_ok": None, "rows_failed": None})
        spans = frame.group_by("run").agg(pl.col("time").min().alias("first"), pl.col("time").max().alias("last"))
        by_index = {row["run"]: row for row in spans.iter_rows(named=True)}
        total = sum((s["last"] - s["first"]).total_seconds() for s in by_index.values())
        unit = next((name, seconds) for limit, name, seconds in UNITS if total <= limit)
        space, offset = RUN_SPACE * total, 0.0
        for run in runs:
            span = by_index.get(run["index"])
            if span is None:
                run.update(seconds=None, first=None, x0=None, x1=None)
                continue
            seconds = (span["last"] - span["first"]).total_seconds()
            run.update(seconds=round(seconds, 1), first=span["first"], x0=offset, x1=offset + seconds)
            offset += seconds + space
        return cls(frame, runs, max(1, int(total // MAX_POINTS) + 1), unit)

    def drawn(self) -> list[dict[str, Any]]:
        """The runs that have samples, in order."""
        return [run for run in self.runs if run.get("first") is not None]

    def last_run(self) -> dict[str, Any] | None:
        """The last run that generated (has samples): the header's."""
        drawn = self.drawn()
        return drawn[-1] if drawn else None

    def rows(self, source: str, *, run: int | None = None) -> Any:
        """The telemetry rows of one source (gpu, host, engine, run), of one run or all; None if none."""
        import polars as pl

        if self.frame is None:
            return None
        rows = self.frame.filter(pl.col("source") == source)
        if run is not None:
            rows = rows.filter(pl.col("run") == run)
        return rows if rows.height else None

    def buckets(self, rows: Any, aggregations: list[Any]) -> Any:
        """`rows` aggregated per run and bucket of `bucket_s` seconds from the run's first sample, with the
        bucket's place on the axis (`x`, seconds) and its clock time (`time`)."""
        import polars as pl

        drawn = pl.DataFrame({"run": [r["index"] for r in self.drawn()], "first": [r["first"] for r in self.drawn()],
                              "x0": [r["x0"] for r in self.drawn()]},
                             schema={"run": pl.Int32, "first": rows.schema["time"], "x0": pl.Float64})
        every = self.bucket_s
        return (rows.with_columns(pl.col("run").cast(pl.Int32)).join(drawn, on="run")
                .with_columns(((pl.col("time") - pl.col("first")).dt.total_microseconds() / 1e6 // every * every)
                              .alias("bucket"))
                .group_by("run", "bucket").agg(pl.col("first").first(), pl.col("x0").first(), *aggregations)
                .with_columns((pl.col("x0") + pl.col("bucket")).alias("x"),
                              (pl.col("first") + pl.duration(seconds=pl.col("bucket"))).alias("time"))
                .sort("x"))

    def series(self, buckets: Any, columns: list[str]) -> dict[str, Any]:
        """Bucketed columns as lists for a chart: `x` in the axis' unit, `time` (clock, for hovering),
        and a point of nulls between two runs and where a run has no sample for GAP_BUCKETS buckets,
        where the chart breaks its line. A column with no value at all is None."""
        scale = self.unit[1]
        out: dict[str, Any] = {"x": [], "time": [], **{c: [] for c in columns}}
        previous: tuple[int, float] | None = None
        for row in buckets.iter_rows(named=True):
            if previous is not None and (row["run"] != previous[0] or row["x"] - previous[1] > GAP_BUCKETS * self.bucket_s):
                out["x"].append(round((previous[1] + self.bucket_s / 2) / scale, 4))
                out["time"].append(None)
                for column in columns:
                    out[column].append(None)
            out["x"].append(round(row["x"] / scale, 4))
            out["time"].append(row["time"].strftime(TIME_FORMAT))
            for column in columns:
                out[column].append(row[column])
            previous = (row["run"], row["x"])
        for column in columns:
            if all(value is None for value in out[column]):
                out[column] = None
        return out

    def axis(self) -> dict[str, Any]:
        """The time axis: its unit, and each drawn run's span on it with its label. The runs are marked
        when there are several, or when the only one did not complete."""
        name, scale = self.unit
        drawn = self.drawn()
        marked = len(drawn) > 1 or any(run["status"] != "completed" for run in drawn)
        return {"unit": name, "title": f"time generating ({name})" + (", runs back to back" if len(drawn) > 1 else ""),
                "runs": [{"label": run["label"], "x0": round(run["x0"] / scale, 4), "x1": round(run["x1"] / scale, 4)}
                         for run in drawn] if marked else []}


def increments(rows: Any) -> Any:
    """Engine rows with their cumulative counters turned into increments since the engine's previous
    sample of the same run; null at a run's first sample, which has no earlier one (an engine that was up
    before the run counts from its own start, not the run's)."""
    import polars as pl

    return rows.sort("time").with_columns([pl.col(c).diff().over("run", "device").clip(lower_bound=0)
                                           for c in COUNTERS])


def _describe(record: RunRecord | None, index: int, count: int, status: str | None, live: bool) -> dict[str, Any]:
    """One run of the manifest: its name, how it ended, whether it resumed an earlier one."""
    name = f"run {index + 1}" if record is not None else "run"
    record = record or RunRecord()
    if record.finished_at is not None:
        ended = "completed"
    elif record.interrupted_at is not None:
        ended = f"interrupted by {record.interrupted_by or 'a signal'}"
    elif index < count - 1:
        ended = "stopped (failed or killed)"  # the next run started: this one left no end
    elif status == "running":
        ended = "running" if live else "killed (no end recorded)"
    else:
        ended = status or "unknown"
    resumed = index > 0
    return {"index": index, "name": name, "status": ended, "resumed": resumed,
            "label": f"{name}{' (resumed)' if resumed else ''}: {ended}", "is_last": index == count - 1,
            "started_at": record.started_at, "ended_at": record.finished_at or record.interrupted_at,
            "rows_ok": record.rows_ok, "rows_failed": record.rows_failed}


def _parse(text: str | None) -> datetime | None:
    """A manifest time (`2026-12-01T02:22:40+0000`, local time with its offset)."""
    if not text:
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S%z").astimezone(timezone.utc)
    except ValueError:
        return None
