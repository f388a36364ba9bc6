"""What a run sets up once the pre-scan of its inputs is done: the manifest, progress, telemetry.

Nothing is written to OUT_DIR before the pre-scan has read every input row (duplicate ids are
refused then, before any result exists). A run whose engine is still to start or load scans
first, while the engine loads. A run on an engine that is already up (a Session's, `qbatch
serve`'s, a benchmark's) would leave it idle for the scan: it hands the engine the first
window's chunks first and scans while they run (runner.py). That engine's processes generate
on their own while this thread scans; the results are written once the run is open, so a
scan that fails leaves the folder as it was.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

from qbatch.engines.base import vector_size
from qbatch.errors import InputError
from qbatch.jobs.job import InputScan, Job
from qbatch.jobs.manifest import input_rows, new_manifest, recording_stop
from qbatch.jobs.progress import Progress
from qbatch.jobs.summary import Summary
from qbatch.jobs.telemetry import Telemetry
from qbatch.log import log
from qbatch.output.columns import ColumnTypes, from_manifest, keep_recorded, to_manifest
from qbatch.output.folder import OutputDir
from qbatch.output.schema import result_schema
from qbatch.output.schema import to_manifest as schema_to_manifest


@dataclass(frozen=True)
class Opened:
    """A run past its pre-scan: what it found, and what records the run."""

    scan: InputScan
    manifest: dict[str, Any]
    progress: Progress
    column_types: ColumnTypes

    @property
    def todo(self) -> int:
        return self.scan.num_todo


class Opening:
    """Opens a run once (`open()`: the pre-scan, then the manifest and progress), either before it
    generates or while a running engine works on its first chunks."""

    def __init__(self, job: Job, out: OutputDir, summary: Summary, done: set[str], previous: dict[str, Any] | None,
                 fingerprint: dict[str, Any], stream: TextIO, progress_class: type[Progress]):
        self.job, self.out, self.summary, self.done = job, out, summary, done
        self._previous, self._fingerprint = previous, fingerprint
        self._stream, self._progress_class = stream, progress_class
        self.opened: Opened | None = None
        self._manifest: dict[str, Any] | None = None  # once written: a stop from then on is recorded in it
        self._telemetry: Telemetry | None = None
        self._engine: Any = None
        self._generating_since: float | None = None
        self._engine_line = ""

    def open(self) -> Opened:
        """The pre-scan (refusing duplicate ids, an empty input with --fail-on-empty), then the manifest
        and the progress; once, later calls return the same."""
        if self.opened is None:
            self.opened = self._open()
        return self.opened

    def _open(self) -> Opened:
        job, spec = self.job, self.job.spec
        scan = job.scan(self.done)
        check_not_empty(job, scan)
        recorded = from_manifest(self._previous)
        column_types = scan.column_types if recorded is None else keep_recorded(recorded, scan.column_types)
        manifest = new_manifest(spec, job.model_path, self._previous, self._fingerprint, status="running")
        manifest.update(engine_choice=self.summary.engine_choice)
        manifest.update(rows_total=scan.num_todo + len(self.done), input_rows=input_rows(job.files, scan.rows_read),
                        covered_inputs=False)
        manifest.update(to_manifest(column_types))
        vectors = vector_size(job.model_path, spec.engine.backend) if spec.engine.task == "embed" else None
        manifest.update(schema_to_manifest(result_schema(spec, column_types, vectors)))
        self.out.write_manifest(manifest)
        self._manifest = manifest
        progress = self._progress_class(spec.output.progress, scan.num_todo, stream=self._stream)
        if spec.engine.task == "embed":
            progress.tokens_of = "input"
        if scan.num_todo:
            progress.log(f"{scan.num_todo} rows to process, {len(self.done)} already done; model {spec.engine.model}")
        else:
            progress.log(f"no rows to process ({len(self.done)} already done, inputs: {', '.join(map(str, job.files))})")
        opened = Opened(scan, manifest, progress, column_types)
        if self._generating_since is not None:  # generating already: the clock and telemetry start from then
            self._start_generating(opened.progress)
        return opened

    def generating(self, engine: Any, line: str) -> float:
        """The engine is ready (`line` says so): generation starts now; when (the progress clock)."""
        self._engine, self._engine_line = engine, line
        self._generating_since = time.monotonic()
        if self.opened is not None:
            self._start_generating(self.opened.progress)
        return self._generating_since

    def _start_generating(self, progress: Progress) -> None:
        progress.log(self._engine_line)
        progress.start_clock(self._generating_since)
        if self.job.spec.output.telemetry:
            self._telemetry = Telemetry(self.out.path, self.summary, progress.total).__enter__()
            self._telemetry.engine = self._engine

    @contextmanager
    def recording_stop(self) -> Iterator[None]:
        """A run that stops says so in its manifest (manifest.recording_stop) once that is written, even
        before the run is fully open; before, nothing was written and the folder stays as it was.
        Telemetry stops with it."""
        try:
            yield
        except BaseException as exc:
            self._stop_telemetry(exc)
            if self._manifest is None:
                raise
            with recording_stop(self.out, self._manifest):
                raise
        self._stop_telemetry(None)

    def _stop_telemetry(self, exc: BaseException | None) -> None:
        telemetry, self._telemetry = self._telemetry, None
        if telemetry is not None:
            telemetry.close(compact_parts=exc is None)  # a stopped run leaves compacting to the next

    def close(self) -> None:
        if self.opened is not None:
            self.opened.progress.close()


def check_not_empty(job: Job, scan: InputScan) -> None:
    """Inputs that hold no rows at all: a warning on stderr, or with --fail-on-empty an error (exit 3),
    so that a scheduler does not take an empty export for a finished job."""
    if scan.num_rows:
        return
    files = ", ".join(map(str, job.files))
    if job.spec.output.fail_on_empty:
        raise InputError("the inputs hold 0 rows", where=files,
                         hint="check the export that wrote them, or drop --fail-on-empty to let an empty run pass")
    log.warning(f"the inputs hold 0 rows: {files}")
