"""What the user reads: the end-of-run summary and `qbatch status`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from qbatch._fs import output_os_errors, read_json
from qbatch.output.folder import RESULT_PREFIX, OutputDir
from qbatch.errors import OutputError
from qbatch.jobs.runner import Summary


def print_summary(summary: Summary) -> None:
    if summary.status == "dry-run":
        _table("dry run (no model loaded)", [
            ("rows valid", f"{summary.rows_ok:,}"),
            ("rows failing validation", f"{summary.rows_failed:,}" + _kinds(summary.failures_by_kind)),
            ("prompt tokens", f"{summary.prompt_tokens:,}"),
            ("chunks planned", f"{summary.num_chunks:,}" + _chunk_range(summary.chunks)),
            ("time", f"{summary.wall_s:.1f}s"),
        ])
        return
    _table(f"qbatch run {summary.status}", [
        ("rows ok (this run)", f"{summary.rows_ok:,}"),
        ("rows failed (this run)", f"{summary.rows_failed:,}" + _kinds(summary.failures_by_kind)),
        ("rows already done", f"{summary.rows_skipped:,}"),
        ("tokens in / out", f"{summary.prompt_tokens:,} / {summary.completion_tokens:,}"),
        ("output tok/s", f"{summary.output_tok_s:,.1f}"),
        ("engine start / generate / wall", f"{summary.engine_start_s:.1f}s / {summary.generate_s:.1f}s / {summary.wall_s:.1f}s"),
        ("of the rest: setup / assemble", f"{summary.setup_s:.1f}s / {summary.assemble_s:.1f}s"),
        ("results", f"{Path(summary.output_dir or '.') / 'results.parquet'} ({summary.total_ok:,} rows)"),
        ("errors", f"{Path(summary.output_dir or '.') / 'errors.parquet'} ({summary.total_failed:,} rows)"),
    ])


def _table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(label) for label, _ in rows)
    click.echo(title)
    for label, value in rows:
        click.echo(f"  {label:<{width}}  {value}")


def _kinds(kinds: dict[str, int]) -> str:
    return f" ({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))})" if kinds else ""


def _chunk_range(chunks: list[dict[str, Any]]) -> str:
    if not chunks:
        return ""
    rows = [c["rows"] for c in chunks]
    return f" ({min(rows)}-{max(rows)} rows each)"


RERUN_HINT = "the run was stopped before it finished: rerun the same `qbatch run` command to resume"


def read_status(output_dir: str) -> dict[str, Any]:
    """Rows done / failed / remaining, last run's throughput, lock holder, completion."""
    folder = OutputDir(output_dir)
    manifest = read_json(folder.manifest_path)
    holder = folder.lock_holder()
    if manifest is None and holder is None:
        raise OutputError("not a qbatch output folder (no manifest.json)", where=output_dir,
                          hint="pass the -o folder of a qbatch run")
    manifest = manifest or {}
    status, hint = _run_state(manifest.get("status"), holder)
    merged_from = manifest.get("merged_from")
    done, failed = _merged_counts(folder) if merged_from else _part_counts(folder)
    stats = read_json(folder.path / "stats.json") or {}
    total = done + failed if merged_from else manifest.get("rows_total")
    return {
        "output_dir": str(folder.path),
        "status": status,
        "completed": status == "completed",
        "running": holder,
        "hint": hint,
        "model": manifest.get("spec", {}).get("model"),
        "rows_total": total,
        "rows_done": done,
        "rows_failed": failed,
        "rows_remaining": None if total is None else max(total - done - failed, 0),
        "parts": len(folder.part_files(RESULT_PREFIX)),
        "merged_from": merged_from,
        "last_run": {key: stats.get(key) for key in ("rows_ok", "rows_failed", "prompt_tokens", "completion_tokens",
                                                    "generate_s", "wall_s", "output_tok_s", "total_tok_s")},
        "updated_at": manifest.get("updated_at"),
    }


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


def _merged_counts(folder: OutputDir) -> tuple[int, int]:
    """A merge's rows are in its final files (its parts stay in the shards' folders)."""
    import pyarrow.parquet as pq

    counts = []
    for name in ("results.parquet", "errors.parquet"):
        path = folder.path / name
        with output_os_errors(f"read {name}", path):
            counts.append(pq.ParquetFile(path).metadata.num_rows if path.exists() else 0)
    return counts[0], counts[1]


def print_status(info: dict[str, Any]) -> None:
    remaining = "unknown" if info["rows_remaining"] is None else f"{info['rows_remaining']:,}"
    last = info["last_run"]
    rows = [
        ("status", info["status"] + (f" ({info['running']})" if info["running"] else "")),
        ("model", str(info["model"])),
        ("rows done", f"{info['rows_done']:,}"),
        ("rows failed", f"{info['rows_failed']:,}"),
        ("rows remaining", remaining),
        ("parts", str(info["parts"])),
    ]
    if info["merged_from"]:
        rows.append(("merged from", f"{len(info['merged_from'])} shards"))
    if last.get("output_tok_s") is not None:
        rows.append(("last run", f"{last['rows_ok']:,} rows, {last['completion_tokens']:,} output tokens, "
                                 f"{last['output_tok_s']:,.1f} output tok/s"))
    if info["hint"]:
        rows.append(("hint", info["hint"]))
    _table(f"qbatch status {info['output_dir']}", rows)
