"""Orchestration: read -> skip done -> prepare -> plan -> generate -> write.

Everything that can be checked without the model (inputs, spec, output
folder, manifest, duplicate ids) is checked before the engine loads, except
that engines in processes of their own (several per host) start right after
the output folder's checks, to load beside the tokenizer and the id pre-scan
(a failed check kills them). An engine that is up before the run (a Session's,
`qbatch serve`'s) gets the first window's chunks before the id pre-scan, which
then runs beside them; nothing is written before it ends (opening.py). Rows are
read, rendered, tokenized and planned in three threads of their own (stages.py)
while the engine generates and this thread counts the rows as they finish and
writes them as parts (parts.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from qbatch.engines.base import Chunk
from qbatch.engines.pool import EnginePool
from qbatch.errors import SpecError
from qbatch.inputs.spool import has_streams, spool_streams, spooled_for_dry_run
from qbatch.jobs.job import Job, PlannedWindow
from qbatch.jobs.manifest import covered_inputs, now, recording_stop
from qbatch.jobs.memory import rare_collections, release_freed_memory
from qbatch.jobs.opening import Opening, check_not_empty
from qbatch.jobs.parts import PartWriter
from qbatch.jobs.progress import Progress
from qbatch.jobs.shape import choose_for_shape
from qbatch.jobs.stages import Stages
from qbatch.jobs.summary import Summary, stats_dict
from qbatch.output.assemble import assemble
from qbatch.output.folder import OutputDir
from qbatch.records import Failure
from qbatch.spec import JobSpec


def run(spec: JobSpec, pool: EnginePool, *, stream: TextIO | None = None,
        progress_class: type[Progress] = Progress) -> Summary:
    """Run a job to completion (or resume it) on the engines of `pool`; progress goes to `stream`
    (default stderr), shown by `progress_class` (the Session passes one that draws a notebook bar in Jupyter)."""
    started = time.monotonic()
    stream = stream or sys.stderr
    if spec.output.dry_run:
        with spooled_for_dry_run(spec) as spooled, rare_collections():
            return dry_run(Job.setup(spooled), started)
    # Inputs read once (stdin, pipes) are copied into the output folder: under its lock, so set up after it.
    job = None if has_streams(spec.input.inputs) else Job.setup(spec)
    if not spec.output.output_dir:
        raise SpecError("no output folder given", hint="pass -o/--output-dir OUT_DIR")
    out = OutputDir(spec.output.output_dir).open()
    try:
        job = job or Job.setup(spool_streams(spec, out.path))
        with rare_collections():
            return _execute(job, out, started, pool, stream, progress_class)
    finally:
        out.close()


def _execute(job: Job, out: OutputDir, started: float, pool: EnginePool, stream: TextIO,
             progress_class: type[Progress] = Progress) -> Summary:
    spec = job.spec
    fingerprint = job.fingerprint(None if spec.output.restart else out.manifest())
    previous = out.check_fingerprint(fingerprint, restart=spec.output.restart)
    done = out.done_ids(include_errors=not spec.output.retry_errors)
    job, choice = choose_for_shape(job, done, pool)  # engines per GPU, torch.compile: before any engine starts
    spec = job.spec
    started_early = _start_engines_early(job, previous, pool)
    job.preparer  # the tokenizer loads here (in this thread, once), while engines started early load too
    # Windows are prepared beside the pre-scan, unless the engine's start forks (then after it).
    early = not pool.would_fork(spec.engine, job.model_path, job.max_model_len)
    summary = Summary(str(out.path), "running", rows_skipped=len(done), task=spec.engine.task,
                      engine_choice=choice.reason if choice else None)
    opening = Opening(job, out, summary, done, previous, fingerprint, stream, progress_class)
    with job.windows(done, start=early) as windows:
        try:
            with opening.recording_stop():
                # On an engine that was up before this run, the pre-scan runs beside its first chunks
                # (opening.py); other runs scan first, while their engine starts.
                if _engine_was_up(job, started_early, pool) or opening.open().todo:
                    summary.setup_s = time.monotonic() - started
                    _generate(job, windows, out, summary, opening, pool, started_early)
        finally:
            opening.close()
    opened = opening.open()
    with recording_stop(out, opened.manifest):
        return _finish(job, out, summary, opened.manifest, started,
                       covered=covered_inputs(spec.input.limit, opened.scan.rows_read))


def _finish(job: Job, out: OutputDir, summary: Summary, manifest: dict[str, Any], started: float, *,
            covered: bool) -> Summary:
    """Assemble results.parquet from the parts; record the run as completed."""
    spec = job.spec
    release_freed_memory()
    t0 = time.monotonic()
    counts = assemble(out, openai_jsonl=spec.output.output_format == "jsonl-openai", model=spec.engine.model)
    summary.assemble_s = time.monotonic() - t0
    summary.total_ok, summary.total_failed = counts["rows_ok"], counts["rows_failed"]
    summary.total_samples = counts.get("samples_ok", counts["rows_ok"])
    summary.status = "completed"
    summary.wall_s = time.monotonic() - started
    out.write_stats(stats_dict(summary))
    manifest.update(status="completed", updated_at=now(), counts=counts, covered_inputs=covered)
    manifest["runs"][-1].update(finished_at=now(), rows_ok=summary.rows_ok, rows_failed=summary.rows_failed)
    out.write_manifest(manifest)
    if spec.output.report:
        from qbatch.report.page import write_report

        write_report(out.path)
    return summary


def _engine_was_up(job: Job, started_early: float | None, pool: EnginePool) -> bool:
    """Whether this run's engine was started (or starting) before the run: it waits for no start."""
    return started_early is None and pool.has(job.spec.engine, job.model_path, job.max_model_len)


def _start_engines_early(job: Job, previous: dict[str, Any] | None, pool: EnginePool) -> float | None:
    """Start engines that run in processes of their own now, so that they load while this process
    loads the tokenizer and scans the inputs (they are killed if a check fails); when they started."""
    if previous is not None and previous.get("status") == "completed":
        return None  # most likely nothing left to do: start no engine for nothing
    return pool.start_early(job.spec.engine, job.model_path, job.max_model_len)


def _generate(job: Job, windows: Stages, out: OutputDir, summary: Summary, opening: Opening, pool: EnginePool,
              started_early: float | None) -> None:
    """Start the engine (or wait for the one started early), feed it the windows' chunks, count rows as
    they finish and write them as parts (parts.py), once the run is open (opening.py)."""
    t0 = time.monotonic()
    engine = pool.get(job.spec.engine, job.model_path, job.max_model_len)
    summary.engine_start_s = time.monotonic() - (started_early or t0)
    early = f", started {t0 - started_early:.1f}s before the setup ended" if started_early else ""
    gen_start = opening.generating(engine, f"engine ready in {summary.engine_start_s:.1f}s{early}")
    spec = job.spec
    parts = PartWriter(out, summary, [str(p) for p in job.files], gen_start, include_prompt=spec.output.include_prompt,
                       embed=spec.embed if spec.engine.task == "embed" else None)
    chunks_open: dict[int, dict[str, Any]] = {}
    windows.start()
    try:
        for finished in engine.run(_chunks(windows, summary, opening, parts, chunks_open)):
            chunk_done = False
            if finished is not None:
                opened = opening.open()
                parts.column_types = opened.column_types
                chunk_done = _take(*finished, summary, opened.progress, parts, chunks_open, gen_start)
            if parts.due(chunk_done=chunk_done):
                parts.write()
        parts.write()
    except BaseException:
        parts.write_on_stop()  # rows waiting for their part are finished: kept, not redone
        raise
    opening.open()
    summary.generate_s = time.monotonic() - gen_start


def _chunks(windows: Iterable[PlannedWindow], summary: Summary, opening: Opening, parts: PartWriter,
            chunks_open: dict[int, dict[str, Any]]) -> Iterator[Chunk]:
    """Number the chunks for the engine; record failures as they come. A run not open yet (opening.py)
    opens once the first window's chunks are with the engine, and records that window's failures then."""
    for window in windows:
        failures = window.failures
        if failures and opening.opened is not None:
            _record_failures(failures, summary, opening.opened.progress, parts)
            failures = []
        for requests in window.chunks:
            chunks_open[summary.num_chunks] = {"index": summary.num_chunks, "rows": 0, "prompt_tokens": 0,
                                               "completion_tokens": 0, "left": len(requests)}
            yield Chunk(summary.num_chunks, requests)
            summary.num_chunks += 1
        opened = opening.open()  # once: the engine has this window's chunks (it may have opened the run meanwhile)
        if failures:
            _record_failures(failures, summary, opened.progress, parts)


def _record_failures(failures: list[Failure], summary: Summary, progress: Progress, parts: PartWriter) -> None:
    parts.add([], failures)
    summary.count_failures(failures)
    progress.update(len(failures), failed=len(failures))


def _take(chunk: Chunk, completions: list, summary: Summary, progress: Progress, parts: PartWriter,
          chunks_open: dict[int, dict[str, Any]], gen_start: float) -> bool:
    """Rows of `chunk` that finished (Completions, or for an embedding job Embeddings), some or all of
    its rows: counted, and handed to the next part; True when they were the chunk's last."""
    ok = [c for c in completions if c.error is None]
    refused = [Failure(c.request.id, parts.sources[c.request.source_index], c.request.row_index, None,
                       "engine_rejected", c.error) for c in completions if c.error is not None]
    parts.add(ok, [])
    if refused:
        _record_failures(refused, summary, progress, parts)
    prompt_tokens = sum(c.request.num_prompt_tokens for c in ok)
    completion_tokens = sum(c.num_generated_tokens for c in ok)  # with n > 1, every sample's
    summary.rows_ok += len(ok)
    summary.samples_ok += sum(1 + len(c.more_samples) for c in ok)
    summary.prompt_tokens += prompt_tokens
    summary.completion_tokens += completion_tokens
    summary.cached_tokens += sum(c.num_cached_tokens for c in ok)
    progress.update(len(ok), tokens=prompt_tokens if parts.embed is not None else completion_tokens)
    tally = chunks_open[chunk.index]
    tally["rows"] += len(ok)
    tally["prompt_tokens"] += prompt_tokens
    tally["completion_tokens"] += completion_tokens
    tally["left"] -= len(completions)
    if tally["left"]:
        return False
    del chunks_open[chunk.index], tally["left"]
    summary.chunks.append({**tally, "finished_s": round(time.monotonic() - gen_start, 3)})
    return True


def dry_run(job: Job, started: float) -> Summary:
    """Read, template, tokenize and validate everything; plan the chunks; load no engine."""
    summary = Summary(None, "dry-run")
    check_not_empty(job, job.scan(set()))
    for item in job.work(set()):
        if item and isinstance(item[0], Failure):
            summary.count_failures(item)
            continue
        summary.rows_ok += len(item)
        summary.prompt_tokens += sum(r.num_prompt_tokens for r in item)
        summary.chunks.append({"index": summary.num_chunks, "rows": len(item),
                               "prompt_tokens": sum(r.num_prompt_tokens for r in item),
                               "max_completion_tokens": sum(r.sampling["max_tokens"] for r in item)})
        summary.num_chunks += 1
    summary.wall_s = time.monotonic() - started
    return summary
