"""`qbatch status`: what an output folder holds and whether a run is live, read from its files."""

from __future__ import annotations

from typing import Any

from qbatch.output.folder import RESULT_PREFIX, OutputDir
from qbatch.output.reading import FINAL_HINT, PART_HINT, reading
from qbatch.output.summary import Summary
from qbatch.errors import OutputError


RERUN_HINT = "the run was stopped before it finished: rerun the same `qbatch run` command to resume"


def read_status(output_dir: str, *, live_run: tuple[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Rows done / failed / remaining, last run's throughput, lock holder, completion. `live_run`: who holds
    the folder and what it said, where the folder's own lock cannot tell (a copy of an object store's folder)."""
    folder = OutputDir(output_dir)
    manifest = folder.manifest()
    live_run = live_run or folder.live_run()
    holder, said = live_run or (None, {})
    if manifest is None and holder is None:
        raise OutputError("not a qbatch output folder (no manifest.json)", where=output_dir,
                          hint="pass the -o folder of a qbatch run")
    status, hint = _run_state(manifest.status if manifest else None, holder)
    merged_from = manifest.merged_from if manifest else None
    done, failed = _merged_counts(folder) if merged_from else _part_counts(folder)
    if status == "completed":
        _check_final_files(folder)
    stats = Summary.read(folder.path / "stats.json")
    saved = stats.save() if stats else {}  # its numbers as stats.json holds them, the rates rounded
    total = done + failed if merged_from else (manifest.rows_total if manifest else None)
    return {
        "output_dir": str(folder.path),
        "status": status,
        "completed": status == "completed",
        "running": holder,
        "hint": hint,
        "model": (manifest.model if manifest else None) or said.get("model"),
        "rows_total": total,
        "rows_done": done,
        "rows_failed": failed,
        "rows_remaining": None if total is None else max(total - done - failed, 0),
        "parts": len(folder.part_files(RESULT_PREFIX)),
        "merged_from": merged_from,
        "last_run": {key: saved.get(key) for key in ("rows_ok", "rows_failed", "prompt_tokens", "completion_tokens",
                                                    "generate_s", "wall_s", "output_tok_s", "total_tok_s")},
        "updated_at": manifest.updated_at if manifest else None,
        "live": _live(folder, total, done, failed, said.get("phase")) if holder is not None else None,
        "flags": stats.flags if stats else None,  # counted over results.parquet's rows, not the last run's alone
        "result_rows": stats.result_rows if stats else None,
        "roofline": stats.roofline if stats else None,
        "plan": manifest.plan if manifest else None,  # what vLLM got and why (plan/record.py); None before it was recorded
    }


RATE_WINDOW_S = 60.0  # current rates are over the last minute of telemetry
RATE_PARTS = 10  # without telemetry: over the last parts written


def _live(folder: OutputDir, total: int | None, done: int, failed: int, phase: str | None) -> dict[str, Any]:
    """A running job's phase (what it said it is doing: OutputDir.set_phase), its current rows/s and
    output tok/s, its ETA and its GPUs' utilization now: from telemetry.parquet's last minute, else from
    the times its last parts were written."""
    rates = _telemetry_rates(folder) or _part_rates(folder)
    rows_s = rates.get("rows_s")
    remaining = None if total is None else max(total - done - failed, 0)
    eta_s = round(remaining / rows_s, 1) if rows_s and remaining is not None else None
    return {"phase": phase, "rows_s": rows_s, "output_tok_s": rates.get("output_tok_s"), "eta_s": eta_s,
            "gpu_util_pct": rates.get("gpu_util_pct"), "rates_from": rates.get("from")}


def _telemetry_rates(folder: OutputDir) -> dict[str, Any] | None:
    from datetime import timedelta

    import polars as pl

    from qbatch.output.telemetry import read

    frame = read(folder.path)
    if frame is None:
        return None
    recent = frame.filter(pl.col("time") >= frame["time"].max() - timedelta(seconds=RATE_WINDOW_S))
    out: dict[str, Any] = {"from": "telemetry"}
    run = recent.filter(pl.col("source") == "run").sort("time")
    if run.height >= 2:
        span = (run["time"][-1] - run["time"][0]).total_seconds()
        if span > 0:
            out["rows_s"] = round((run["rows_done"][-1] - run["rows_done"][0]) / span, 2)
    engine = recent.filter(pl.col("source") == "engine").sort("time")
    if engine.height >= 2:
        out["output_tok_s"] = round(_engine_rate(engine, "generation_tokens"), 1)
        if out.get("rows_s") in (None, 0):  # the run counted no row in the window: the engines' count
            out["rows_s"] = round(_engine_rate(engine, "finished_requests"), 2) or out.get("rows_s")
    gpus = frame.filter(pl.col("source") == "gpu")
    if gpus.height:
        latest = gpus.filter(pl.col("time") == gpus["time"].max())
        out["gpu_util_pct"] = {str(d): u for d, u in latest.select("device", "gpu_util_pct").iter_rows()}
    return out


def _engine_rate(engine: Any, column: str) -> float:
    """A cumulative engine counter's rate, summed over the engines (a restarted counter counts 0)."""
    import polars as pl

    ends = engine.group_by("device").agg(pl.col(column).first().alias("a"), pl.col(column).last().alias("b"),
                                         pl.col("time").first().alias("t0"), pl.col("time").last().alias("t1"))
    return float(sum((b - a) / (t1 - t0).total_seconds() for _, a, b, t0, t1 in ends.iter_rows()
               if (t1 - t0).total_seconds() > 0 and a is not None and b is not None and b >= a))


def _part_rates(folder: OutputDir) -> dict[str, Any]:
    """Rows/s over the last RATE_PARTS result parts, from their row counts and write times."""
    import pyarrow.parquet as pq

    with reading(folder.parts, PART_HINT):
        parts = sorted(folder.part_files(RESULT_PREFIX), key=lambda p: p.stat().st_mtime)[-RATE_PARTS:]
    if len(parts) < 2:
        return {"from": "parts"}
    rows = 0
    for part in parts[1:]:
        with reading(part, PART_HINT):
            rows += pq.ParquetFile(part).metadata.num_rows
    span = parts[-1].stat().st_mtime - parts[0].stat().st_mtime
    return {"from": "parts", "rows_s": round(rows / span, 2) if span > 0 else None}


def _run_state(status: str | None, holder: str | None) -> tuple[str, str | None]:
    """The state to report and its hint. The manifest says what the last run wrote, the lock
    whether a run is live: a live run that has not written its manifest yet is starting, and
    a manifest still 'running' with no live run was left by a killed run."""
    if holder is not None:
        return ("running" if status == "running" else "starting"), None
    if status == "running":
        return "interrupted", RERUN_HINT
    return str(status), RERUN_HINT if status == "failed" else None


def _part_counts(folder: OutputDir) -> tuple[int, int]:
    """Ids done and failed, by the rule a resumed run uses (OutputDir.done_ids)."""
    ok = folder.result_ids()
    return len(ok), len(folder.error_ids() - ok)


def _check_final_files(folder: OutputDir) -> None:
    """A completed run's results.parquet and errors.parquet can be read (their footers: cheap)."""
    import pyarrow.parquet as pq

    for name in ("results.parquet", "errors.parquet"):
        path = folder.path / name
        if path.exists() or path.is_symlink():
            with reading(path, FINAL_HINT):
                pq.ParquetFile(path).close()


def _merged_counts(folder: OutputDir) -> tuple[int, int]:
    """A merge's rows are in its final files (its parts stay in the shards' folders)."""
    import pyarrow.parquet as pq

    counts = []
    for name in ("results.parquet", "errors.parquet"):
        path = folder.path / name
        with reading(path, FINAL_HINT):
            if not path.exists():
                counts.append(0)
            elif "sample_index" in pq.ParquetFile(path).schema_arrow.names:  # n > 1: a result row a sample
                counts.append(len(pq.read_table(path, columns=["id"])["id"].unique()))
            else:
                counts.append(pq.ParquetFile(path).metadata.num_rows)
    return counts[0], counts[1]
