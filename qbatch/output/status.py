"""`qbatch status`: what an output folder holds and whether a run is live, read from its files."""

from __future__ import annotations

from typing import Any

from qbatch._fs import output_os_errors, read_json
from qbatch.output.folder import RESULT_PREFIX, OutputDir
from qbatch.errors import OutputError


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
