"""A run's opening, once the pre-scan of its inputs is done: the manifest, then the progress.

Nothing is written to OUT_DIR before the pre-scan has read every input row (duplicate ids are
refused then, before any result exists). A run whose engine is still to start or load scans
first, while the engine loads. A run on an engine that is already up (a Session's, `qbatch
serve`'s, a benchmark's) would leave it idle for the scan: it hands the engine the first
window's chunks first and scans while they run (runner.py). That engine's processes generate
on their own while this thread scans; the results are written once the run is open, so a
scan that fails leaves the folder as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qbatch.engines.base import vector_size
from qbatch.errors import InputError
from qbatch.jobs.events import RunEvents
from qbatch.jobs.job import InputScan, Job
from qbatch.jobs.manifest import input_rows, new_manifest
from qbatch.jobs.progress import Progress
from qbatch.log import log
from qbatch.output.columns import ColumnTypes, from_manifest, keep_recorded, to_manifest
from qbatch.output.done import DoneIds
from qbatch.output.fingerprint import Fingerprint
from qbatch.output.folder import OutputDir
from qbatch.output.manifest import Manifest
from qbatch.output.schema import own_names, result_schema
from qbatch.output.schema import to_manifest as schema_to_manifest
from qbatch.output.widening import widen_parts
from qbatch.plan.record import plan_record


@dataclass(frozen=True)
class Found:
    """What OUT_DIR held before the run: the previous run's manifest, the rows done, and this run's
    fingerprint (checked against the previous one's)."""

    previous: Manifest | None
    fingerprint: Fingerprint
    done: DoneIds


@dataclass(frozen=True)
class Opened:
    """A run past its pre-scan: what it found, the column types its results keep, and its progress."""

    scan: InputScan
    column_types: ColumnTypes
    progress: Progress

    @property
    def todo(self) -> int:
        return self.scan.num_todo


def pre_scan(job: Job, found: Found) -> InputScan:
    """Every input row read once: duplicate ids refused, an empty input warned of (or refused)."""
    scan = job.scan(found.done)
    check_not_empty(job, scan)
    return scan


def open_manifest(job: Job, out: OutputDir, found: Found, scan: InputScan, engine_choice: str | None
                  ) -> tuple[Manifest, ColumnTypes]:
    """Write this run's manifest (status running, the rows to do, the results' schema, the engines' plan); it and the column
    types the results keep (those the folder's earlier runs recorded win)."""
    spec = job.spec
    recorded = from_manifest(found.previous.column_schema if found.previous is not None else None)
    column_types = scan.column_types if recorded is None else keep_recorded(recorded, scan.column_types)
    if recorded is not None:  # rows appended to the input may widen a column: the parts written so far follow
        widen_parts(out, recorded, column_types, own=own_names(spec))
    manifest = new_manifest(spec, job.model_path, found.previous, found.fingerprint, status="running")
    manifest.engine_choice = engine_choice
    manifest.plan = plan_record(job.plan)  # what vLLM gets, and why
    manifest.rows_total = scan.num_todo + len(found.done)
    manifest.input_rows = input_rows([job.input_name(p) for p in job.files], scan.rows_read)
    manifest.covered_inputs = False
    manifest.columns, manifest.column_schema = to_manifest(column_types)
    vectors = vector_size(job.model_path, spec.engine.backend) if spec.engine.task == "embed" else None
    manifest.result_schema = schema_to_manifest(result_schema(spec, column_types, vectors))
    out.write_manifest(manifest)
    return manifest, column_types


def start_progress(job: Job, found: Found, scan: InputScan, events: RunEvents) -> Progress:
    """The run's progress over the rows to do, and its first line."""
    spec = job.spec
    progress = Progress(spec.output.progress, scan.num_todo, events)
    if spec.engine.task == "embed":
        progress.tokens_of = "input"
    if scan.num_todo:
        progress.log(f"{scan.num_todo} rows to process, {len(found.done)} already done; model {spec.engine.model}")
    else:
        progress.log(f"no rows to process ({len(found.done)} already done, inputs: {', '.join(map(str, job.files))})")
    return progress


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
