"""What the user reads: the end-of-run summary and `qbatch status`."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import click

from qbatch.output.folder import ERROR_PREFIX, LOCK_NAME, RESULT_PREFIX, OutputDir, read_json
from qbatch.errors import OutputError
from qbatch.run.runner import Summary


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


def read_status(output_dir: str) -> dict[str, Any]:
    """Rows done / failed / remaining, last run's throughput, lock holder, completion."""
    import pyarrow.parquet as pq

    folder = OutputDir(output_dir)
    manifest = read_json(folder.manifest_path)
    if manifest is None:
        raise OutputError("not a qbatch output folder (no manifest.json)", where=output_dir,
                          hint="pass the -o folder of a qbatch run")
    ok_ids: set[str] = set()
    for path in folder.part_files(RESULT_PREFIX):
        ok_ids.update(pq.read_table(path, columns=["id"]).column("id").to_pylist())
    failed_ids: set[str] = set()
    for path in folder.part_files(ERROR_PREFIX):
        failed_ids.update(pq.read_table(path, columns=["id"]).column("id").to_pylist())
    failed_ids -= ok_ids
    stats = read_json(folder.path / "stats.json") or {}
    total = manifest.get("rows_total")
    return {
        "output_dir": str(folder.path),
        "status": manifest.get("status"),
        "completed": manifest.get("status") == "completed",
        "running": _lock_holder(folder.path),
        "model": manifest.get("spec", {}).get("model"),
        "rows_total": total,
        "rows_done": len(ok_ids),
        "rows_failed": len(failed_ids),
        "rows_remaining": None if total is None else max(total - len(ok_ids) - len(failed_ids), 0),
        "parts": len(folder.part_files(RESULT_PREFIX)),
        "last_run": {key: stats.get(key) for key in ("rows_ok", "rows_failed", "prompt_tokens", "completion_tokens",
                                                    "generate_s", "wall_s", "output_tok_s", "total_tok_s")},
        "updated_at": manifest.get("updated_at"),
    }


def _lock_holder(folder: Path) -> str | None:
    """Who holds the run lock, or None when no live run does."""
    path = folder / LOCK_NAME
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown process"
    finally:
        os.close(fd)


def print_status(info: dict[str, Any]) -> None:
    remaining = "unknown" if info["rows_remaining"] is None else f"{info['rows_remaining']:,}"
    last = info["last_run"]
    rows = [
        ("status", info["status"] + (f" (running: {info['running']})" if info["running"] else "")),
        ("model", str(info["model"])),
        ("rows done", f"{info['rows_done']:,}"),
        ("rows failed", f"{info['rows_failed']:,}"),
        ("rows remaining", remaining),
        ("parts", str(info["parts"])),
    ]
    if last.get("output_tok_s") is not None:
        rows.append(("last run", f"{last['rows_ok']:,} rows, {last['completion_tokens']:,} output tokens, "
                                 f"{last['output_tok_s']:,.1f} output tok/s"))
    _table(f"qbatch status {info['output_dir']}", rows)
