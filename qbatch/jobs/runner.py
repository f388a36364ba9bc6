"""Orchestration: read -> skip done -> prepare -> plan -> generate -> write, as the phases of one run.

A run's phases, called in order from one place (_Run.execute): what OUT_DIR holds (the resume
check), the pre-scan, the manifest and progress (opening.py), generation, and its end: completed
(results assembled) or stopped at the caller's request (events.py). Everything that can be checked
without the model (inputs, spec, output folder, manifest, duplicate ids) is checked before the
engine loads, except that engines in processes of their own (several per host) start right after
the output folder's checks, to load beside the tokenizer and the id pre-scan (a failed check kills
them). An engine that is up before the run (a Session's, `qbatch serve`'s) gets the first window's
chunks before the pre-scan, which then runs beside them; nothing is written before it ends. Rows
are read, rendered, tokenized and planned in three threads of their own (stages.py) while the
engine generates and this thread counts the rows as they finish and writes them as parts
(parts.py). The run alone changes its Summary; the modules it calls return what it records.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

from qbatch.engines.base import Chunk
from qbatch.engines.pool import EnginePool
from qbatch.errors import SpecError
from qbatch.inputs.remote import copied_for_dry_run, has_remote, spool_remote
from qbatch.inputs.spool import has_streams, spool_streams
from qbatch.jobs.events import RunEvents
from qbatch.jobs.job import Job, ChunkedWindow
from qbatch.jobs.manifest import covered_inputs, now, record_interrupted, recording_stop
from qbatch.jobs.memory import rare_collections, release_freed_memory
from qbatch.jobs.opening import Found, Opened, check_not_empty, open_manifest, pre_scan, start_progress
from qbatch.jobs.parts import PartWriter
from qbatch.jobs.shape import choose_for_shape
from qbatch.jobs.stages import Stages
from qbatch.output.summary import Summary
from qbatch.jobs.telemetry import Telemetry
from qbatch.jobs.yardstick import estimate, measure
from qbatch.log import log
from qbatch.output.assemble import assemble
from qbatch.output.done import DoneIds
from qbatch.output.folder import IDS_ONLY, OutputDir
from qbatch.output.manifest import Manifest
from qbatch.plan import Plan
from qbatch.plan.roofline import Work
from qbatch.records import Failure, Request
from qbatch.spec import JobSpec
from qbatch.storage.stage import StagedFolder, staged
from qbatch.storage.urls import Url, is_remote

# Memory the windows freed is handed back to the OS at most this often, as parts are written: glibc
# keeps it in the stage threads' arenas otherwise, and a run of 1M rows grew by 100 MB more without
# (docs/benchmarks.md, "memory per row"); a trim takes a few milliseconds.
TRIM_EVERY_S = 5.0


def run(spec: JobSpec, pool: EnginePool, events: RunEvents | None = None, *,
        stage: StagedFolder | None = None) -> Summary:
    """Run a job to completion (or resume it) on the engines of `pool`. `events`: its progress for the
    caller, and the caller's stop: a run stopped so returns with status "interrupted", the rows
    finished by then written. `stage`: the object store's folder whose local copy the output folder is,
    where the caller staged it (a Session's call, which writes its rows there and reads the results there);
    an output folder given as a URL is staged here."""
    events = events or RunEvents()
    started = time.monotonic()
    if spec.output.dry_run:
        with copied_for_dry_run(spec) as (copies, names), rare_collections():
            return dry_run(choose_for_shape(Job.setup(copies, names=names), DoneIds(), pool), started)
    if not spec.output.output_dir:
        raise SpecError("no output folder given", hint="pass -o/--output-dir OUT_DIR")
    if is_remote(spec.output.output_dir):
        return _run_staged(spec, pool, events, started)
    return _run_in(spec, pool, events, started, stage)


def _run_in(spec: JobSpec, pool: EnginePool, events: RunEvents, started: float,
            stage: StagedFolder | None = None) -> Summary:
    """The run in the local folder spec.output.output_dir: `stage`'s copy of a folder in an object store,
    where given, and then the inputs inside it (a Session's rows, a spooled stdin) are recorded by their
    URLs there, as a resume from another copy (another machine) finds them."""
    # Inputs read once (stdin, pipes) and objects of a store are copied into the output folder: under its
    # lock, so set up after it.
    assert spec.output.output_dir is not None
    copied = has_streams(spec.input.inputs) or has_remote(spec.input.inputs)
    job = None if copied else Job.setup(spec)
    out = OutputDir(spec.output.output_dir, make_whole=None if stage is None else stage.fill).open()
    try:
        if job is None:
            copies, names = spool_remote(spool_streams(spec, out.path), out.path)
            job = Job.setup(copies, names=names)
        if stage is not None:
            job = replace(job, input_names={**stage.urls_of(job.files), **job.input_names})
        with rare_collections():
            return _Run(job, out, pool, events, started).execute()
    except BaseException:
        _undo_open(out)
        raise
    finally:
        out.close()


def _run_staged(spec: JobSpec, pool: EnginePool, events: RunEvents, started: float) -> Summary:
    """A run whose output folder is in an object store: on a local copy that the store is kept in step with
    (storage/stage.py), under the folder's lock there; the summary names the store's folder."""
    url = spec.output.output_dir
    assert url is not None  # run() chose this path for an output folder given as a URL
    with staged_output(url) as folder:
        local = replace(spec, output=replace(spec.output, output_dir=str(folder.path)))
        summary = _run_in(local, pool, events, started, folder)
    return replace(summary, output_dir=url)


def staged_output(url: str) -> AbstractContextManager[StagedFolder]:
    """The local copy a run works in of the object store's folder `url`, under its lock (storage/stage.py):
    the parts and final tables copied thin (their ids: what the resume reads), made whole when the run
    assembles; what the run wrote uploaded even when it fails, for its resume."""
    return staged(url, keep_on_failure=True, thin=IDS_ONLY)


def _undo_open(out: OutputDir) -> None:
    """A run that failed before its first row leaves OUT_DIR as it found it (issue #53.7), but for what
    says why (engine.log), named here. A folder that cannot be listed or changed is left as it is: the
    run's own error, which is about that folder, is the one to show first."""
    try:
        kept = out.undo_open()
    except Exception as exc:
        log.debug(f"what the run added to {out.path} stays: {exc}")
        return
    if kept:
        log.warning(f"the run wrote no row: {out.path} keeps only {', '.join(kept)}")


@dataclass
class _ChunkTally:
    """A chunk's finished rows and their tokens so far, and its rows still out."""

    index: int
    left: int
    rows: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def record(self, finished_s: float) -> dict[str, Any]:
        """The summary's record of the chunk once its last row is in (`finished_s` into the generation)."""
        return {"index": self.index, "rows": self.rows, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "finished_s": round(finished_s, 3)}


class _Run:
    """One run's phases and what they share: the job, its output folder, the pool, the caller's events,
    and the run's Summary, manifest and progress once they exist."""

    def __init__(self, job: Job, out: OutputDir, pool: EnginePool, events: RunEvents, started: float):
        self.job, self.out, self.pool, self.events, self.started = job, out, pool, events, started
        self.summary = Summary(str(out.path), "running", task=job.spec.engine.task,
                               adapters={} if job.spec.engine.lora else None)
        self.manifest: Manifest | None = None  # once written: a stop from then on is recorded in it
        self.opened: Opened | None = None
        self._parts: PartWriter | None = None
        self._tallies: dict[int, _ChunkTally] = {}  # chunks with rows still out
        self._held: list[Failure] = []  # the windows' failures before the run opened
        self._windows_handed = 0  # windows whose chunks the engine has
        self._telemetry: Telemetry | None = None
        self._trimmed = time.monotonic()

    def execute(self) -> Summary:
        found, started_early = self._prepare()
        job = self.job
        engine_up = started_early is None and self.pool.has(job.plan.engine)
        # Windows are prepared beside the pre-scan, unless the engine's start forks (then after it).
        early = not self.pool.would_fork(job.plan.engine)
        stopped = False
        with job.windows(found.done, start=early) as windows:
            try:
                with self._recording_stop():
                    if not engine_up:  # the pre-scan while the engine starts (one up scans beside its first chunks)
                        self._open(found)
                    if engine_up or (self.opened is not None and self.opened.todo):
                        self.summary.setup_s = time.monotonic() - self.started
                        stopped = self._generate(windows, found, started_early)
            finally:
                if self.opened is not None:
                    self.opened.progress.close()
        self._stop_telemetry(compact=not stopped)  # a stopped run leaves compacting to the next
        if stopped:
            return self._stopped()
        with recording_stop(self.out, self._opened()[0]):
            return self._finish()

    # -- the phases, in order ---------------------------------------------------
    def _prepare(self) -> tuple[Found, float | None]:
        """What OUT_DIR holds (the fingerprint checked, the rows done); the engines the job's shape calls
        for; engines in processes of their own started now, to load while this process loads the
        tokenizer and scans the inputs (they are killed if a check fails), and when they started."""
        spec = self.job.spec
        self._phase("reading the inputs")
        fingerprint = self.job.fingerprint(None if spec.output.restart else self.out.manifest())
        previous = self.out.check_fingerprint(fingerprint, restart=spec.output.restart)
        found = Found(previous, fingerprint, self.out.done_ids(include_errors=not spec.output.retry_errors))
        self.job = choose_for_shape(self.job, found.done, self.pool)  # before any engine starts
        choice = self.job.plan.choice
        self.summary.rows_skipped = len(found.done)
        self.summary.engine_choice = choice.reason if choice else None
        started_early = None
        if previous is None or previous.status != "completed":  # a completed job most likely has nothing left
            started_early = self.pool.start_early(self.job.plan.engine)
        self.job.preparer  # the tokenizer loads here (in this thread, once), while engines started early load too
        return found, started_early

    def _open(self, found: Found) -> None:
        """The pre-scan, then the manifest (from then on a stop is recorded), then the progress."""
        scan = pre_scan(self.job, found)
        self.manifest, column_types = open_manifest(self.job, self.out, found, scan, self.summary.engine_choice)
        self.opened = Opened(scan, column_types, start_progress(self.job, found, scan, self.events))

    def _generate(self, windows: Stages, found: Found, started_early: float | None) -> bool:
        """Start the engine (or wait for the one started early), feed it the windows' chunks, count rows
        as they finish and write them as parts; True when the caller's stop ended the generation."""
        job = self.job
        t0 = time.monotonic()
        if self.opened is not None and (started_early or not self.pool.has(job.plan.engine)):
            starting = f"starting the engine (loading {job.spec.engine.model})"
            self._phase(starting)
            self.opened.progress.log(f"{starting}…")  # a phase of its own, before the bar
        engine = self.pool.get(job.plan.engine)
        self.summary.engine_start_s = time.monotonic() - (started_early or t0)
        early = f", started {t0 - started_early:.1f}s before the setup ended" if started_early else ""
        ready = f"engine ready in {self.summary.engine_start_s:.1f}s{early}"
        generating_since = time.monotonic()
        spec = job.spec
        self._parts = PartWriter(self.out, job.input_labels, generating_since,
                                 include_prompt=spec.output.include_prompt,
                                 embed=spec.embed if spec.engine.task == "embed" else None)
        windows.start()
        outputs = engine.run(self._feed(windows))
        try:
            finished: list[Any] = []
            if self.opened is None:  # an engine that was up: the pre-scan runs beside its first chunks
                finished = self._hand_over_first_window(outputs)
                self._open(found)
            self.parts.column_types = self._opened()[1].column_types
            self._begin_reporting(engine, ready, generating_since)
            held, self._held = self._held, []
            self._record_failures(held)
            stopped = self._take_all(chain(finished, outputs))
            self._write_part()
        except BaseException:
            self._write_part(on_stop=True)  # rows waiting for their part are finished: kept, not redone
            raise
        finally:
            close = getattr(outputs, "close", None)
            if close is not None:
                close()  # an engine stopped early aborts the requests it still holds
        self.summary.generate_s = time.monotonic() - generating_since
        return stopped

    def _finish(self) -> Summary:
        """Assemble results.parquet from the parts; record the run as completed."""
        spec, summary = self.job.spec, self.summary
        release_freed_memory()
        t0 = time.monotonic()
        assembled = assemble(self.out, openai_jsonl=spec.output.output_format == "jsonl-openai", model=spec.engine.model)
        summary.assemble_s = time.monotonic() - t0
        summary.total_ok, summary.total_failed = assembled.rows_ok, assembled.rows_failed
        summary.total_samples = assembled.samples_ok
        summary.flags = assembled.flags  # stats.json says them; the manifest counts rows
        measure(self.job, summary)
        summary.status = "completed"
        summary.wall_s = time.monotonic() - self.started
        self.out.write_stats(summary)
        manifest, opened = self._opened()
        manifest.status, manifest.updated_at, manifest.counts = "completed", now(), assembled.counts
        manifest.covered_inputs = covered_inputs(spec.input.limit, opened.scan.rows_read)
        run = manifest.runs[-1]
        run.finished_at, run.rows_ok, run.rows_failed = now(), summary.rows_ok, summary.rows_failed
        self.out.write_manifest(manifest)
        if spec.output.report:
            from qbatch.report.page import write_report

            write_report(self.out.path)
        return summary

    def _stopped(self) -> Summary:
        """The caller's stop: the run is recorded interrupted (by the stop's reason), its parts kept for a resume."""
        record_interrupted(self.out, self._opened()[0], self.events.stop_reason)
        self.summary.status = "interrupted"
        self.summary.wall_s = time.monotonic() - self.started
        return self.summary

    # -- generation ---------------------------------------------------------------
    def _feed(self, windows: Iterable[ChunkedWindow]) -> Iterator[Chunk]:
        """The windows' chunks, numbered for the engine; each window's failures recorded as it comes."""
        for window in windows:
            self._record_failures(window.failures)
            for requests in window.chunks:
                index = self.summary.num_chunks
                self._tallies[index] = _ChunkTally(index, len(requests))
                yield Chunk(index, requests)
                self.summary.num_chunks += 1
            self._windows_handed += 1

    def _hand_over_first_window(self, outputs: Iterator[Any]) -> list[Any]:
        """Run the engine until it has the first window's chunks, or its first rows are back (or it is
        done); the rows back by then, to be taken once the run is open."""
        finished = []
        for item in outputs:
            if item is not None:
                finished.append(item)
            if finished or self._windows_handed:
                break
        return finished

    def _take_all(self, outputs: Iterable[Any]) -> bool:
        """Take the engine's rows as they come, writing parts when due; True when the caller's stop ended it
        (looked at each time the engine reports)."""
        for item in outputs:
            chunk_done = item is not None and self._take(*item)
            if self.parts.due(chunk_done=chunk_done):
                self._write_part()
            if self.events.stop.is_set():
                return True
        return False

    def _take(self, chunk: Chunk, completions: list[Any]) -> bool:
        """Rows of `chunk` that finished (Completions, or for an embedding job Embeddings), some or all of
        its rows: counted, and handed to the next part; True when they were the chunk's last."""
        summary, parts = self.summary, self.parts
        ok = [c for c in completions if c.error is None]
        refused = [Failure(c.request.id, parts.sources[c.request.source_index], c.request.row_index, None,
                           "engine_rejected", c.error) for c in completions if c.error is not None]
        parts.add(ok, [])
        self._record_failures(refused)
        prompt_tokens = sum(c.request.num_prompt_tokens for c in ok)
        completion_tokens = sum(c.num_generated_tokens for c in ok)  # with n > 1, every sample's
        summary.rows_ok += len(ok)
        summary.samples_ok += sum(1 + len(c.more_samples) for c in ok)
        summary.prompt_tokens += prompt_tokens
        summary.completion_tokens += completion_tokens
        summary.cached_tokens += sum(c.num_cached_tokens for c in ok)
        summary.count_adapters(ok)
        summary.count_work(ok)
        self._opened()[1].progress.update(len(ok), tokens=prompt_tokens if parts.embed is not None else completion_tokens)
        tally = self._tallies[chunk.index]
        tally.rows += len(ok)
        tally.prompt_tokens += prompt_tokens
        tally.completion_tokens += completion_tokens
        tally.left -= len(completions)
        if tally.left:
            return False
        del self._tallies[chunk.index]
        summary.chunks.append(tally.record(time.monotonic() - parts.generating_since))
        return True

    def _record_failures(self, failures: list[Failure]) -> None:
        """Rows that failed: counted and handed to the next part, once the run is open (held until then)."""
        if not failures:
            return
        if self.opened is None:
            self._held += failures
            return
        self.parts.add([], failures)
        self.summary.count_failures(failures)
        self.opened.progress.update(len(failures), failed=len(failures))

    def _write_part(self, *, on_stop: bool = False) -> None:
        record = self.parts.write_on_stop() if on_stop else self.parts.write()
        if record is not None:
            self.summary.parts.append(record)
        if time.monotonic() - self._trimmed >= TRIM_EVERY_S:
            release_freed_memory()
            self._trimmed = time.monotonic()

    # -- reporting ---------------------------------------------------------------
    def _begin_reporting(self, engine: Any, ready: str, generating_since: float) -> None:
        """The engine is ready (`ready` says so) and the run open: rates count from the generation's start,
        telemetry samples from now."""
        progress = self._opened()[1].progress
        progress.log(ready)
        progress.start_clock(generating_since)
        self._phase(f"generating: {progress.total:,} rows to process")
        if self.job.spec.output.telemetry:
            self._telemetry = Telemetry(self.out.path, self.summary, progress.total).__enter__()
            self._telemetry.engine = engine

    def _opened(self) -> tuple[Manifest, Opened]:
        """The run's manifest and what its opening found: both there once `_open` ran."""
        if self.manifest is None or self.opened is None:
            raise RuntimeError("the run is not open yet")
        return self.manifest, self.opened

    @property
    def parts(self) -> PartWriter:
        """The writer of the run's parts, there once the generation started."""
        if self._parts is None:
            raise RuntimeError("the generation has not started")
        return self._parts

    def _phase(self, phase: str) -> None:
        """What the run is doing now, for `qbatch status` (OutputDir.set_phase)."""
        self.out.set_phase(phase, model=self.job.spec.engine.model)

    @contextmanager
    def _recording_stop(self) -> Iterator[None]:
        """A run that stops (a signal, a failure) says so in its manifest once that is written, even before
        the run is fully open; before, nothing was written and the folder stays as it was."""
        try:
            yield
        except BaseException:
            self._stop_telemetry(compact=False)
            if self.manifest is None:
                raise
            with recording_stop(self.out, self.manifest):
                raise

    def _stop_telemetry(self, *, compact: bool) -> None:
        telemetry, self._telemetry = self._telemetry, None
        if telemetry is not None:
            telemetry.close(compact_parts=compact)


def plan(spec: JobSpec, pool: EnginePool) -> Plan:
    """The plan a run of `spec` on `pool` would follow (its shape sampled where it may choose the engines);
    nothing is written, no engine starts."""
    with copied_for_dry_run(spec) as (copies, names):
        return choose_for_shape(Job.setup(copies, names=names), DoneIds(), pool).plan


def dry_run(job: Job, started: float) -> Summary:
    """Read, template, tokenize and validate everything; plan the chunks; load no engine. The summary
    carries the plan in words."""
    summary = Summary(None, "dry-run", plan=str(job.plan))
    work = Work()
    check_not_empty(job, job.scan(DoneIds()))
    for item in job.work(DoneIds()):
        if failures := [f for f in item if isinstance(f, Failure)]:
            summary.count_failures(failures)
            continue
        chunk = [r for r in item if isinstance(r, Request)]
        summary.rows_ok += len(chunk)
        summary.prompt_tokens += sum(r.num_prompt_tokens for r in chunk)
        summary.chunks.append({"index": summary.num_chunks, "rows": len(chunk),
                               "prompt_tokens": sum(r.num_prompt_tokens for r in chunk),
                               "max_completion_tokens": sum(r.sampling["max_tokens"] for r in chunk)})
        summary.num_chunks += 1
        work = work.plus(Work.of_rows([(r.num_prompt_tokens, r.sampling["max_tokens"] * r.sampling.get("n", 1))
                                       for r in chunk]))
    summary.estimate = estimate(job, work).as_dict()
    summary.wall_s = time.monotonic() - started
    return summary
