"""A job: its plan (the spec resolved against the machine and the model: qbatch/plan/), its input
files, its fingerprint, and its rows prepared window by window in stage threads.

A window's rows go through three stages, each in a thread of its own (stages.py), each passing
a small frozen record to the next: RowWindow (rows to prepare) -> RenderedWindow (prompts
rendered, rows refused) -> EncodedWindow (token ids) -> ChunkedWindow (failures and the chunks
the engine gets).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from itertools import chain, islice
from pathlib import Path
from typing import Any

from qbatch.engines.base import hidden_size
from qbatch.engines.lora import batch_adapters
from qbatch.errors import InputError, SpecError
from qbatch.inputs.prepare import Draft, Encoded, Preparer, generation_defaults, in_shard
from qbatch.tokens import load_tokenizer
from qbatch.inputs.row_kinds import STAND_IN_HINT, NamedColumns, StandIns
from qbatch.inputs.readers import detect_format, expand_inputs, parquet_schema, read_rows, rows_size
from qbatch.jobs.chunking import DOCUMENT_SAMPLE, FIRST_WINDOW, by_adapter, cut_group_chunks, order_groups
from qbatch.jobs.ids import DigestLog, RepeatedIds, id_digest
from qbatch.jobs.prefixes import shares_prefixes
from qbatch.jobs.stages import Stages
from qbatch.log import log
from qbatch.models import registry as models
from qbatch.models.adapters import adapters_identity
from qbatch.models.ready import ready_model
from qbatch.output.columns import ColumnScan, ColumnTypes
from qbatch.output.done import DoneIds
from qbatch.output.fingerprint import Fingerprint, input_identity, may_grow
from qbatch.output.folder import DUPLICATE_ID
from qbatch.output.manifest import Manifest
from qbatch.plan import Machine, Plan, probe, resolve
from qbatch.plan.placement import no_gpu_notes
from qbatch.records import Failure, Request, Row
from qbatch.sampling import SAMPLING_KEY_SET
from qbatch.spec import EMBEDDING_ONLY, JobSpec, SamplingSpec, parse_shard

_PREPARER_LOCK = threading.Lock()

MAX_LISTED_DUPLICATES = 10
MAX_PLACES = 3  # where a duplicated id appears, in the error: its first few places


@dataclass(frozen=True, slots=True)
class RowWindow:
    """Rows to prepare, with their ids, and the duplicates --dedupe dropped among them."""

    rows: list[tuple[Row, str]]
    failures: list[Failure]


@dataclass(frozen=True, slots=True)
class RenderedWindow:
    """Prompts rendered (chat template or raw text); rows refused so far."""

    drafts: list[Draft]
    failures: list[Failure]


@dataclass(frozen=True, slots=True)
class EncodedWindow:
    """Prompts tokenized, one entry per draft."""

    drafts: list[Draft]
    failures: list[Failure]
    encoded: list[Encoded]


@dataclass(frozen=True, slots=True)
class ChunkedWindow:
    """A window's rows that failed, and its requests cut into the chunks the engine gets (in order)."""

    failures: list[Failure]
    chunks: list[list[Request]]


@dataclass(frozen=True)
class InputScan:
    """What the pre-scan found in the inputs."""

    num_todo: int  # rows this run must process
    rows_read: list[int]  # rows read per input file, in every shard, done or not
    column_types: ColumnTypes  # carried columns' types for the whole input (output/columns.py)

    @property
    def num_rows(self) -> int:
        return sum(self.rows_read)


@dataclass(frozen=True)
class Job:
    """A job's plan (the resolved spec, the engines' configuration: qbatch/plan/) and its inputs. `spec`
    is the resolved spec; the caller's spec is never changed. A new plan for the job's shape
    (with_plan) keeps the tokenizer loaded for the old one: it reads no engine setting."""

    plan: Plan
    files: list[Path]
    # Per input, the bytes of it this run reads (readers.rows_size), None: all of it. Decided once, here:
    # the fingerprint hashes and the pre-scan and the run read those bytes, whatever a writer appends meanwhile.
    input_sizes: tuple[int | None, ...] | None = None
    loaded: dict[str, Preparer] = field(default_factory=dict, compare=False, repr=False)  # shared by with_plan
    # LoRA adapters whose weights cannot be used, each with what is wrong: left out of the engines, their rows fail
    unusable_adapters: dict[str, str] = field(default_factory=dict)
    # the ids the pre-scan found more than once, once it has run (shared by with_plan, as `loaded`)
    repeats: RepeatedIds = field(default_factory=RepeatedIds, compare=False, repr=False)
    # The name the run records an input under where it is not its path: a remote object's URL, by its local
    # copy's path (inputs/remote.py)
    input_names: dict[str, str] = field(default_factory=dict)

    @classmethod
    def setup(cls, spec: JobSpec, machine: Machine | None = None, names: dict[str, str] | None = None) -> Job:
        """The job of `spec`: its inputs found, the machine and model probed (unless given), the spec resolved.
        `names`: the URL of each input copied from an object store, by its copy's path."""
        files = expand_inputs(spec.input.inputs)
        sizes = tuple(rows_size(path) if may_grow(path, detect_format(path, spec.input.format)) else None
                      for path in files)
        # the model made ready (downloaded, converted, quantized), then the machine and the model read (the
        # adapters checked against it there)
        machine = machine or probe(spec, ready_model(spec))
        plan = resolve(spec, machine)  # an embedding job's adapters left out there: it runs the base model
        if spec.engine.lora and spec.engine.task == "embed":
            log.warning("an embedding job runs the base model: lora ignored")
        for note in no_gpu_notes(spec.engine, machine):  # GPU-only settings without a GPU: what each does here
            log.warning(note)
        if spec.engine.task == "embed":
            check_dimensions(plan.spec, plan.model_path)
            _warn_generation_settings(spec)
        return cls(plan, files, sizes, unusable_adapters=plan.unusable_adapters, input_names=names or {})

    def input_name(self, path: Path) -> str:
        """What the run records the input `path` as (fingerprint, manifest, `source`): its URL when it is the
        copy of an object, else its resolved path."""
        return self.input_names.get(str(path)) or str(path.resolve())

    @property
    def input_labels(self) -> list[str]:
        """The inputs as the results' `source` column names them: a copy's URL, else the path as found."""
        return [self.input_names.get(str(p)) or str(p) for p in self.files]

    def with_plan(self, plan: Plan) -> Job:
        return self if plan == self.plan else replace(self, plan=plan)

    @property
    def spec(self) -> JobSpec:
        return self.plan.spec

    @property
    def model_path(self) -> str:
        return self.plan.model_path

    @property
    def max_model_len(self) -> int:
        return self.plan.max_model_len

    @property
    def weights_bytes(self) -> int | None:
        return self.plan.machine.model.weights_bytes

    @property
    def preparer(self) -> Preparer:
        """Loaded on first use: importing Transformers and loading the tokenizer takes seconds,
        which engines started first spend loading beside it."""
        with _PREPARER_LOCK:  # the service's online requests ask for it on many threads at once: one loads it
            if "preparer" not in self.loaded:
                self.loaded["preparer"] = self._load_preparer()
        return self.loaded["preparer"]

    def _load_preparer(self) -> Preparer:
        spec = self.spec
        tokenizer = load_tokenizer(spec.engine.tokenizer or self.model_path, spec.engine.revision)
        base = {**generation_defaults(self.model_path), "max_tokens": spec.sampling.max_tokens}
        base.update({k: v for k, v in asdict(spec.sampling).items()
                     if v is not None and v is not False and k in SAMPLING_KEY_SET and (k, v) != ("n", 1)})
        structured = spec.sampling.structured_outputs()
        if structured is not None:
            base["structured_outputs"] = structured
        return Preparer(spec, tokenizer, max_model_len=self.max_model_len, base_sampling=base,
                        positional_prefix=len(self.files) > 1, unusable_adapters=self.unusable_adapters)

    def fingerprint(self, previous: Manifest | None = None) -> Fingerprint:
        """What the results depend on; hashes every input once (with the prefix the `previous`
        manifest's fingerprint saw of each input, so that appended rows can resume)."""
        settings = self.spec.result_settings()
        if settings["task"] == "generate":  # the embedding settings change no generation: fingerprints as before them
            for name in ("task", *EMBEDDING_ONLY):
                settings.pop(name)
        structured = self.spec.sampling.structured_outputs()
        if structured is not None:  # the schema or grammar files' content, not their names
            settings["structured_outputs"] = structured
        if settings["lora"] is None:  # folders written before adapters existed: their fingerprint has no key for them
            settings.pop("lora")
        else:  # the adapters' content, not their folders: a changed adapter file is a changed setting
            settings["lora"] = adapters_identity(self.spec.engine.lora)
        if settings["backend"] == "ray":  # the same vLLM engine, run elsewhere: a run may change backend and resume
            settings["backend"] = "vllm"
        seen = previous.fingerprint.seen_sizes() if previous is not None else {}
        formats = [detect_format(p, self.spec.input.format) for p in self.files]
        inputs = [replace(input_identity(p, f, seen_size=seen.get(self.input_name(p)), size=size), path=self.input_name(p))
                  for p, f, size in zip(self.files, formats, self.sizes, strict=True)]
        return Fingerprint(settings, models.model_identity(self.spec.engine.model, self.model_path), tuple(inputs))

    @property
    def sizes(self) -> list[int | None]:
        return list(self.input_sizes) if self.input_sizes is not None else [None] * len(self.files)

    def rows(self) -> Iterator[Row]:
        rows = read_rows(self.files, fmt=self.spec.input.format, on_bad_line=self.spec.input.on_bad_line,
                         sizes=self.sizes)
        return islice(rows, self.spec.input.limit) if self.spec.input.limit else rows

    def identified_rows(self, done: DoneIds) -> Iterator[tuple[Row, str]]:
        """(row, id) for the rows this run must process: in its shard, not done yet."""
        shard = parse_shard(self.spec.input.shard) if self.spec.input.shard else None
        for row in self.rows():
            rid = self.preparer.row_id(row)
            if in_shard(rid, shard) and rid not in done:
                yield row, rid

    def work(self, done: DoneIds) -> Iterator[list[Failure] | list[Request]]:
        """Each window's failures (when there are any), then its chunks of requests."""
        with self.windows(done) as windows:
            for window in windows:
                if window.failures:
                    yield window.failures
                yield from window.chunks

    def windows(self, done: DoneIds, *, start: bool = True) -> Stages:
        """Each window's failures and chunks, in one list, prepared in three threads (started now, or by start()).

        Rendering (read, parse, check, template: Python), encoding (the tokenizer's own threads,
        outside the GIL: most of the work) and chunking (token ids as lists, requests, sort,
        chunks) each get a thread, so the encoder never waits for Python work. What consumes
        the windows (the engine, the writer) runs beside them too.
        """
        return Stages(self._row_windows(done), ("qbatch-render", self._render), ("qbatch-encode", self._encode),
                      ("qbatch-chunk", self._chunk), start=start)

    def _row_windows(self, done: DoneIds) -> Iterator[RowWindow]:
        """Windows of (row, id) to process, with the duplicates that --dedupe drops from them.

        Windows grow from FIRST_WINDOW rows to sort_window: the engine gets its first requests
        once a few rows are encoded, not after a whole window. The rows left at the end
        join the last full window (which then holds up to twice sort_window rows): a short last
        window of its own would start its longest rows after all the others, to run almost alone
        at the end (benchmarks/simulate_order.py models it; docs/benchmarks.md has the figures).
        Windows are held back one window to see the end.

        The ids met are remembered to drop (--dedupe) a later row of the same id: every one until the
        pre-scan (which runs beside the first windows) has found which ids repeat, then only those
        (ids.py): a run's memory does not grow by its rows' ids.

        Rows that share documents (longest-first order, the first DOCUMENT_SAMPLE rows' prompts
        sharing long prefixes: prefixes.py) get whole windows from the start instead: a document's
        questions meet only inside one window, and a vLLM cache too small for every document
        computes a document again in each window that has one of its questions.
        """
        seen: set[str] = set()
        window: list[tuple[Row, str]] = []
        failures: list[Failure] = []
        full: RowWindow | None = None
        rows = self.identified_rows(done)
        sample = list(islice(rows, DOCUMENT_SAMPLE))  # read and rendered only: cheap beside encoding
        size = min(FIRST_WINDOW, self.spec.plan.sort_window)
        if size < self.spec.plan.sort_window and self._shares_documents(sample):
            size = self.spec.plan.sort_window
        for row, rid in chain(sample, rows):
            if not self._may_repeat(rid):
                window.append((row, rid))
            elif rid in seen:  # only reached with --dedupe: duplicates were refused up front otherwise
                failures.append(Failure(rid, row.source, row.row_index, row.line, DUPLICATE_ID,
                                        f"id '{rid}' already appeared earlier in the input; dropped by --dedupe"))
            else:
                seen.add(rid)
                window.append((row, rid))
            if len(window) + len(failures) >= size:
                if full is not None:
                    yield full
                full, window, failures = RowWindow(window, failures), [], []
                size = min(2 * size, self.spec.plan.sort_window)
        if full is not None:
            window, failures = full.rows + window, full.failures + failures
        if window or failures:
            yield RowWindow(window, failures)

    def _may_repeat(self, rid: str) -> bool:
        repeated = self.repeats.digests
        return repeated is None or (bool(repeated) and id_digest(rid) in repeated)

    def _shares_documents(self, rows: list[tuple[Row, str]]) -> bool:
        """Whether these rows' prompts share documents (the rule in _row_windows); logged once."""
        if self.spec.plan.order != "longest-first":
            return False
        drafts, _ = self.preparer.render(rows)
        if not shares_prefixes([draft.text or "" for draft in drafts]):
            return False
        log.info("rows share long prompt prefixes (a document asked several questions): windows of %d rows "
                 "from the start, so that a document's rows meet", self.spec.plan.sort_window)
        return True

    def _render(self, window: RowWindow) -> RenderedWindow:
        drafts, refused = self.preparer.render(window.rows)
        return RenderedWindow(drafts, window.failures + refused)

    def _encode(self, window: RenderedWindow) -> EncodedWindow:
        return EncodedWindow(window.drafts, window.failures, self.preparer.encode(window.drafts))

    def _chunk(self, window: EncodedWindow) -> ChunkedWindow:
        requests, refused = self.preparer.requests(window.drafts, window.encoded)
        groups = order_groups(requests, self.spec.plan.order)
        if self.spec.engine.lora and self.spec.plan.order != "input":
            groups = by_adapter(groups, batch_adapters(self.spec.engine))
        chunks = cut_group_chunks(groups, self.plan.chunk_tokens)
        return ChunkedWindow(window.failures + refused, list(chunks))

    def count_todo(self, done: DoneIds) -> int:
        """Rows to process; refuses duplicate ids (before the model loads) unless --dedupe."""
        return self.scan(done).num_todo

    def scan(self, done: DoneIds) -> InputScan:
        """The pre-scan of every input row, before the model loads: rows to process (refusing
        duplicate ids unless --dedupe, and columns the job names that no row has), rows read, and
        the carried columns' types.

        The types are decided on every row read, whatever its shard and whether it is done,
        so that shards and resumed runs decide alike.
        """
        shard = parse_shard(self.spec.input.shard) if self.spec.input.shard else None
        columns = ColumnScan(self._parquet_schemas())
        named = NamedColumns(self.spec.input)
        preparer = self.preparer
        todo = DigestLog()
        rows_read = [0] * len(self.files)
        for row in self.rows():
            rows_read[row.source_index] += 1
            if row.data is not None:
                extra, fails = preparer.carried(row)
                columns.add(extra, row.source_index, fails=fails)
                named.add(row)
            rid = preparer.row_id(row)
            if in_shard(rid, shard) and rid not in done:
                todo.add(id_digest(rid))
        named.check()
        repeated = todo.repeated()
        counts, stand_ins = self._count_repeated(repeated, shard, done)
        self._refuse_duplicates(counts, shard, done, stand_ins.clashes(counts))
        self.repeats.digests = repeated
        return InputScan(len(todo), rows_read, columns.finish())

    def _count_repeated(self, repeated: set[int], shard: tuple[int, int] | None, done: DoneIds
                        ) -> tuple[dict[str, int], StandIns]:
        """The rows of each id whose digest repeats, and the stand-ins among them: a second reading of the
        inputs, only when some digest repeats (a duplicated id, or two ids that share a digest, which
        their counts here tell apart: each once)."""
        counts: dict[str, int] = {}
        stand_ins = StandIns(self.spec.input)
        if not repeated:
            return counts, stand_ins
        for row in self.rows():
            rid = self.preparer.row_id(row)
            if id_digest(rid) in repeated and in_shard(rid, shard) and rid not in done:
                counts[rid] = counts.get(rid, 0) + 1
                stand_ins.add(row, rid)
        return counts, stand_ins

    def _parquet_schemas(self) -> dict[int, Any]:
        return {i: parquet_schema(path) for i, path in enumerate(self.files)
                if detect_format(path, self.spec.input.format) == "parquet"}

    def _refuse_duplicates(self, counts: dict[str, int], shard: tuple[int, int] | None, done: DoneIds,
                           clashes: list[str]) -> None:
        """Refuse ids that appear more than once (unless --dedupe), each listed one with where it appears;
        and, --dedupe or not, stand-in ids (`clashes`) that name more than one row."""
        if clashes:
            one = len(clashes) == 1
            raise InputError(f"{len(clashes)} row{'' if one else 's'} without a usable id {'is' if one else 'are'} "
                             f"named by {'its position' if one else 'their positions'}, which {'is' if one else 'are'} "
                             f"also another row's id: {self._listed(clashes, counts, shard, done)}", hint=STAND_IN_HINT)
        duplicates = [rid for rid, n in counts.items() if n > 1]
        if duplicates and not self.spec.input.dedupe:
            raise InputError(f"{len(duplicates)} ids appear more than once: "
                             f"{self._listed(duplicates, counts, shard, done)}",
                             hint="pass --dedupe to keep the first of each, or --id-column to pick a unique column")

    def _listed(self, ids: list[str], counts: dict[str, int], shard: tuple[int, int] | None, done: DoneIds) -> str:
        """The first MAX_LISTED_DUPLICATES of `ids`, each with where it appears."""
        shown = ids[:MAX_LISTED_DUPLICATES]
        places = self._places(set(shown), shard, done)
        for rid in shown:
            if counts[rid] > MAX_PLACES:
                places[rid].append(f"{counts[rid]} times in all")
        listed = ", ".join(f"{rid!r} ({', '.join(places[rid])})" for rid in shown)
        return listed + (f" and {len(ids) - MAX_LISTED_DUPLICATES} more" if len(ids) > MAX_LISTED_DUPLICATES else "")

    def _places(self, ids: set[str], shard: tuple[int, int] | None, done: DoneIds) -> dict[str, list[str]]:
        """Where each of `ids` appears (file:line, or file row N for Parquet), the first MAX_PLACES of each:
        a second reading of the inputs, made only to say so in an error."""
        places: dict[str, list[str]] = {rid: [] for rid in ids}
        for row in self.rows():
            rid = self.preparer.row_id(row)
            if rid in places and in_shard(rid, shard) and rid not in done and len(places[rid]) < MAX_PLACES:
                name = Path(row.source).name
                places[rid].append(f"{name}:{row.line}" if row.line is not None else f"{name} row {row.row_index}")
        return places


def check_dimensions(spec: JobSpec, model_path: str) -> None:
    """--dimensions keeps the first N values of the model's vectors: at most its hidden size (checked
    before the model loads, from config.json; a model whose config does not say is checked by its output)."""
    size = hidden_size(model_path)
    if spec.embed.dimensions is not None and size is not None and spec.embed.dimensions > size:
        raise SpecError(f"dimensions must be at most the model's embedding size {size}, got {spec.embed.dimensions}",
                        where="--dimensions", hint=f"pass --dimensions N with 1 <= N <= {size}, or leave it out")


def _warn_generation_settings(spec: JobSpec) -> None:
    """An embedding job generates nothing: sampling settings (a job file's keys) do not apply to it."""
    defaults = SamplingSpec()
    ignored = [f.name for f in fields(SamplingSpec)
               if f.name != "ignore_eos" and getattr(spec.sampling, f.name) != getattr(defaults, f.name)]
    if ignored:
        log.warning("an embedding job generates nothing: %s ignored", ", ".join(ignored))
