"""What a run records in OUT_DIR/manifest.json (the record: output/manifest.py): its fingerprint and spec,
its status as it goes (running, interrupted, failed, completed), the rows it read, and the runs so far."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from qbatch.errors import OutputError
from qbatch.log import log
from qbatch.output.fingerprint import Fingerprint
from qbatch.output.folder import OutputDir
from qbatch.output.manifest import InputRows, Manifest, RunRecord
from qbatch.spec import JobSpec
from qbatch.versions import __version__, package_versions

MAX_RUNS = 20  # runs listed in a manifest, latest last


def new_manifest(spec: JobSpec, model_path: str, previous: Manifest | None, fingerprint: Fingerprint, *,
                 status: str) -> Manifest:
    """The manifest of this run: the previous one's history, this run's fingerprint, spec and versions."""
    base = previous or Manifest(created_at=now())
    return replace(base, qbatch_version=__version__, status=status, updated_at=now(), fingerprint=fingerprint,
                   spec=json.loads(json.dumps(spec.flat(), default=str)), versions=package_versions(),
                   limit=spec.input.limit, model_path=model_path,
                   runs=[*base.runs, RunRecord(started_at=now(), pid=os.getpid())][-MAX_RUNS:])


def input_rows(names: list[str], rows_read: list[int]) -> list[InputRows]:
    """Rows read from each input (by its resolved path, or an object's URL: Job.input_name), for `qbatch
    merge` to tell which shard read less."""
    return [InputRows(name, n) for name, n in zip(names, rows_read, strict=True)]


def covered_inputs(limit: int | None, rows_read: list[int]) -> bool:
    """Whether a completed run read every row of its inputs: --limit N stopped it early unless
    the inputs held fewer than N rows."""
    return limit is None or sum(rows_read) < limit


@contextmanager
def recording_stop(out: OutputDir, manifest: Manifest) -> Iterator[None]:
    """A run stopped by a signal (KeyboardInterrupt, errors.Interrupted) or a failure says so in the
    manifest, for `qbatch status` and schedulers; its finished parts stay, and a rerun resumes.
    A failure to say so (the disk that filled up and stopped the run) is a warning: the error shown is
    the one that stopped the run, not the manifest's."""
    try:
        yield
    except KeyboardInterrupt as exc:
        with _saying_stop():
            record_interrupted(out, manifest, getattr(exc, "signal_name", "SIGINT"))
        raise
    except BaseException:
        with _saying_stop():
            manifest.status, manifest.updated_at = "failed", now()
            out.write_manifest(manifest)
        raise


@contextmanager
def _saying_stop() -> Iterator[None]:
    try:
        yield
    except OutputError as exc:
        log.warning(f"the manifest could not record how the run stopped: {exc}")


def record_interrupted(out: OutputDir, manifest: Manifest, by: str) -> None:
    """The run stopped before its end (by a signal's name, or a caller's stop reason): its parts stay for a resume."""
    manifest.status, manifest.updated_at = "interrupted", now()
    manifest.runs[-1].interrupted_at, manifest.runs[-1].interrupted_by = now(), by
    out.write_manifest(manifest)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
