"""The warm Session: `qbatch run` from Python, on engines that stay loaded between calls.

A thin door onto the CLI's run, not a copy of it: in-memory data is written as an input
file into the run's output folder (a temporary one unless `output_dir` is given), the job
runs through `runner.run` with a JobSpec built from the CLI's setting names, and the results
are read back from results.parquet and errors.parquet. Preparation, validation, chunks,
parts, resume and the fingerprint are therefore the CLI's own.

A Session owns a pool of engines (engines/pool.py), started by its first call and kept for
the next, and closes them when it is closed (`close()`, the end of a `with` block, or
interpreter exit); given a pool (`pool=`), it runs on that pool's engines and leaves them to
the pool's owner: two Sessions of one pool share their engines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qbatch.engines import vllm_output
from qbatch.engines.pool import EnginePool
from qbatch.errors import SpecError, Stopped
from qbatch.jobs import runner
from qbatch.jobs.events import RunEvents
from qbatch.jobs.runtime import this_process
from qbatch.output.summary import Summary
from qbatch.log import setup as setup_log
from qbatch.session.data import input_paths
from qbatch.session.keywords import keyword_errors
from qbatch.session.progress import notebook_bar, shows_notebook_bar
from qbatch.session.reply import Reply
from qbatch.session.result import Frames, RunResult, as_frames, frames_of, read_result
from qbatch.spec import (DEFAULT_MODEL, ENGINE_SETTINGS, JOB_OWN_ENGINE_SETTINGS, EngineSpec, JobSpec,
                         from_environment)
from qbatch.storage.stage import StagedFolder
from qbatch.storage.urls import SCHEMES, is_remote

if TYPE_CHECKING:
    from qbatch.plan import Plan

MANGLED_URLS = tuple(f"{scheme}:/" for scheme in SCHEMES)  # what Path("s3://bucket/out") makes of a URL
SESSION_HINT = "engine settings go to Session(model=..., ...); job settings to each run(...) call"
ENGINE_LOG = "engine.log"  # in a run's output folder (`qbatch run`), or serve's data folder


class Session:
    """Engines started once (on the first call) and reused by every call until `close()`.

    Engine settings (`model`, `max_model_len`, `gpu_memory_utilization`, `backend`, ... : the
    `qbatch run` flags of the engine) are fixed for the session; job settings (`max_tokens`,
    `thinking`, `template`, `output_dir`, ...) are given per call; `lora={"NAME": "PATH"}` gives it LoRA
    adapters, which rows pick by name (an `adapter` column, or `adapter=` on the quick paths). `session.pool` holds the
    engines (qbatch.engines.pool.EnginePool): the session's own, or the one it was given.
    """

    # Each call sets qbatch's log level from its `progress` (warnings only for "none" or under a notebook's
    # bar). False: the program using the Session owns the level (qbatch serve, whose own lines, from other
    # threads, must show while a run goes on), and calls leave it as they find it.
    sets_log_level = True

    def __new__(cls, *args: Any, server: str | None = None, **settings: Any) -> Any:
        """`server=URL`: no engines here; the quick paths on a running `qbatch serve` (a RemoteSession)."""
        if server is None:
            return super().__new__(cls)
        from qbatch.session.remote import RemoteSession

        return RemoteSession(server, **({"model": args[0]} if args and args[0] is not None else {}), **settings)

    def __init__(self, model: str | None = None, *, engine_log: str | os.PathLike[str] | None = None,
                 pool: EnginePool | None = None, server: None = None, **engine_settings: Any) -> None:
        """`engine_log`: the file vLLM's own output goes to (its log lines, its processes' prints);
        by default this process's session log under qbatch's cache (`session.engine_log` says which).
        `pool`: the engines to run on, its owner's to close (default: a pool of this session's own,
        closed with it); Sessions of one pool share its engines."""
        engine_settings = {key.replace("-", "_"): value for key, value in engine_settings.items()}
        job_keys = sorted(set(engine_settings) - ENGINE_SETTINGS)
        if job_keys:
            raise SpecError(f"'{job_keys[0]}' is not an engine setting", where="Session(...)", hint=SESSION_HINT)
        given = {"model": model} if model else {}
        self.engine_settings: dict[str, Any] = {"model": DEFAULT_MODEL, **from_environment(EngineSpec), **given,
                                                **engine_settings}
        with keyword_errors():  # bad values fail now, not at the first run
            JobSpec.from_flat(self.engine_settings, source="Session(...)")
        self.runtime = this_process()  # the process's engine machinery (jobs/runtime.py), started at the first run
        self.engine_log = Path(engine_log) if engine_log is not None else _default_engine_log()
        self.closed = False
        self.pool = pool if pool is not None else EnginePool(kept=True)
        self._owns_pool = pool is None

    @classmethod
    def for_spec(cls, spec: JobSpec, *, pool: EnginePool | None = None,
                 engine_log: str | os.PathLike[str] | None = None) -> Session:
        """A Session on a whole spec's engine settings: the door `qbatch run` goes through. vLLM's output
        goes to `engine_log`, by default the spec's output folder's engine log (an object store's folder:
        the process's session log, as a Session's; a path made of its URL would be a local folder `s3:`)."""
        settings = dataclasses.asdict(spec.engine)
        folder = spec.output.output_dir
        if engine_log is None and folder and not is_remote(folder):
            engine_log = Path(folder) / ENGINE_LOG
        return cls(settings.pop("model"), engine_log=engine_log, pool=pool, **settings)

    # -- calls -------------------------------------------------------------
    def run_spec(self, spec: JobSpec, events: RunEvents | None = None) -> Summary:
        """Run a complete spec, its inputs and output folder its own (`qbatch run`); its engine
        settings must be this session's, but for its task (an embedding job gets an engine of its own,
        as embed() does) and the job's own seed and adapters (JOB_OWN_ENGINE_SETTINGS). `events`: the
        caller's progress, bar and stop (`qbatch serve` running a job handed to it); a stopped run raises
        Stopped."""
        self._check_open()
        engine = dataclasses.asdict(spec.engine)
        for name in ("task", *JOB_OWN_ENGINE_SETTINGS):
            engine.pop(name)
        self._check_engine(engine)
        return self._run_spec(spec, events=events)

    def run(self, data: Any, *, output_dir: str | os.PathLike[str] | None = None,
            on_progress: Callable[[int, int], None] | None = None, stop_request: threading.Event | None = None,
            frames: Frames | None = None, **job_settings: Any) -> RunResult:
        """Generate for every row of `data`, as `qbatch run` does; see RunResult.

        `data`: a path or glob (str or Path), a list of Paths, a polars or pandas DataFrame, a list
        of dicts (rows, as JSONL lines) or a list of prompt strings (ids "0", "1", ...). With
        `output_dir` the run checkpoints there and a rerun resumes, as the CLI's `-o`.
        `on_progress(rows_done, rows_failed)` (this call's counts) runs as rows finish, about once a
        second, and when the last is done. `stop_request`: an event another thread may set (a
        `qbatch.jobs.events.StopRequest` also says why): the run stops within about a second, the rows
        finished by then written, and run() raises `qbatch.errors.Stopped`; the run is `interrupted`,
        its parts kept for a resume, the engines warm.
        `frames`: "polars", "pandas" or "arrow", the kind of the results and errors tables; by default
        the data's own (a pandas DataFrame: pandas, a pyarrow Table: arrow; paths, lists and polars:
        polars). Errors name settings as keyword arguments (`max_tokens=`), not as the CLI's flags.
        """
        with keyword_errors():
            self._check_open()
            kind = frames_of(data, frames)
            with _output_folder(output_dir) as (folder, stage):
                spec = self._spec(data, folder, job_settings, "session.run(...)")
                summary = self._run_spec(spec, on_progress, stop_request, stage=stage)
                return read_result(summary, _named(output_dir, folder), kind)

    def plan(self, data: Any, **job_settings: Any) -> Plan:
        """The plan a `run(data, **job_settings)` would follow, nothing run and no engine started: each
        engine's LLM(...) arguments and why, engines per GPU, memory share, compile mode, chunk size
        (`print(plan)` shows them)."""
        with keyword_errors():
            self._check_open()
            with _output_folder(None) as (folder, _):
                return runner.plan(self._spec(data, folder, job_settings, "session.plan(...)"), self.pool)

    def embed(self, data: Any, *, output_dir: str | os.PathLike[str] | None = None, frames: Frames | None = None,
              **job_settings: Any) -> Any:
        """Embedding vectors of every row of `data`, as `qbatch embed` makes them: id, the input's other
        columns, embedding (an Array of floats) and prompt_tokens, in input order.

        `data` is what run() takes (a list of strings: texts with ids "0", "1", ...); settings are
        `qbatch embed`'s (dimensions, normalize, instruction, truncate, embedding_dtype, template, ...).
        A row that cannot be embedded raises (embed_result() returns the errors instead). The model is
        the session's: Session(model="Qwen/Qwen3-Embedding-0.6B").embed(texts). A table of the data's kind,
        or `frames`' (as run()).
        """
        kind = frames_of(data, frames)
        result = self.embed_result(data, output_dir=output_dir, frames="polars", **job_settings)
        if result.errors.height:
            from qbatch.errors import InputError

            first = result.errors.row(0, named=True)
            raise InputError(f"{result.errors.height} rows could not be embedded; the first: {first['error']}: "
                             f"{first['message']}", where=f"id {first['id']}",
                             hint="truncate=True embeds the start of over-long texts; session.embed_result(...) "
                                  "returns the rows that worked and an errors frame")
        return as_frames(result.results, kind)

    def embed_result(self, data: Any, *, output_dir: str | os.PathLike[str] | None = None,
                     on_progress: Callable[[int, int], None] | None = None,
                     stop_request: threading.Event | None = None, frames: Frames | None = None,
                     **job_settings: Any) -> RunResult:
        """embed() with its errors: a RunResult, as run() returns (the same job path, task "embed")."""
        with keyword_errors():
            self._check_open()
            kind = frames_of(data, frames)
            with _output_folder(output_dir) as (folder, stage):  # task embed: an engine of its own, closed with the session
                spec = self._spec(data, folder, job_settings, "session.embed(...)", task="embed")
                summary = self._run_spec(spec, on_progress, stop_request, stage=stage)
                return read_result(summary, _named(output_dir, folder), kind)

    def generate(self, prompts: Sequence[str], **settings: Any) -> list[str]:
        """Completions of prompt strings, in order (each sent as a user turn through the chat template).
        `adapter="NAME"`: every prompt through one of the session's LoRA adapters (Session(lora={...}))."""
        return _texts(self.replies("prompt", prompts, **settings))

    def chat(self, conversations: Sequence[list[dict[str, Any]]], **settings: Any) -> list[str]:
        """Completions of conversations ({role, content} lists), in order."""
        return _texts(self.replies("messages", conversations, **settings))

    def replies(self, column: str, values: Sequence[Any], **settings: Any) -> list[Reply]:
        """One Reply per value of a `prompt` or `messages` column, in order, failed rows included.

        The quick paths (this, generate, chat, the LangChain model) build the rows themselves, one a
        value, and return one answer a row: settings that choose other rows or columns, or more answers
        a row (n > 1), are refused; run() takes them. `adapter`: the LoRA adapter every row goes through
        (a name the session's `lora` gives; None: the base model), as run()'s rows name theirs in an
        `adapter` column."""
        with keyword_errors():
            return self._replies(column, values, settings)

    def _replies(self, column: str, values: Sequence[Any], settings: dict[str, Any]) -> list[Reply]:
        if column not in ("prompt", "messages"):
            raise SpecError(f"column must be 'prompt' or 'messages', got {column!r}")
        adapter = settings.pop("adapter", None)
        if adapter is not None and adapter not in (self.engine_settings.get("lora") or {}):
            raise SpecError(f"adapter={adapter!r} is not one of this session's LoRA adapters: "
                            f"{', '.join(sorted(self.engine_settings.get('lora') or {})) or 'it has none'}",
                            where="adapter=", hint="Session(model=..., lora={'NAME': 'PATH'}) names them")
        values = _quick_values(column, values, settings)
        if not values:
            return []
        rows = [{"id": str(i), column: value, **({"adapter": adapter} if adapter else {})}
                for i, value in enumerate(values)]
        result = self.run(rows, frames="polars", **settings)
        replies = {row["id"]: Reply(row["text"], row["reasoning"], row["finish_reason"], row["prompt_tokens"],
                                    row["completion_tokens"])
                   for row in result.results.select(*_REPLY_COLUMNS).iter_rows(named=True)}
        for row in result.errors.iter_rows(named=True):
            replies.setdefault(row["id"], Reply(None, error=row["error"], message=row["message"]))
        return [replies.get(str(i), Reply(None, error="missing", message="no result")) for i in range(len(values))]

    # -- lifetime ----------------------------------------------------------
    def close(self) -> None:
        """Shut down the engines of this session's own pool (idempotent); a pool given is left to its owner."""
        self.closed = True
        if self._owns_pool and self.pool.engines():
            self.runtime.route_engine_log(self.engine_log)  # vLLM's shutdown lines go with the rest
            self.pool.close_all()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self.engine_settings.items())
        return f"Session({settings}{', closed' if self.closed else ''})"

    # -- internals ---------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise SpecError("this Session is closed", hint="start a new one: qbatch.Session(model=...)")

    def _spec(self, data: Any, folder: Path, job_settings: dict[str, Any], source: str, **fixed: Any) -> JobSpec:
        """A call's job: the session's engine settings plus the call's job settings (a different engine
        refused) and `fixed` (what the call itself sets), its data written into `folder`, its output there."""
        self._check_engine(job_settings)
        values = dict(self.engine_settings)
        values.update((key.replace("-", "_"), value) for key, value in job_settings.items())
        values.update(fixed, inputs=input_paths(data, folder), output_dir=str(folder))
        return JobSpec.from_flat(values, source=source)

    def _check_engine(self, settings: dict[str, Any]) -> None:
        """Refuses settings that name another engine than this session's (or the data as a setting)."""
        defaults = EngineSpec()
        for key, value in settings.items():
            name = key.replace("-", "_")
            if name == "inputs":
                raise SpecError("the data is run()'s first argument", where="inputs=",
                                hint="session.run(data, ...) with a path, a DataFrame or a list of rows")
            if name in ENGINE_SETTINGS:
                current = self.engine_settings.get(name, getattr(defaults, name))
                if value != current:
                    raise SpecError(f"{name} is an engine setting, fixed for this session ({current!r}); "
                                    f"got {value!r}", where="session.run(...)",
                                    hint=f"start another Session(..., {name}={value!r}) for it")

    def _run_spec(self, spec: JobSpec, on_progress: Callable[[int, int], None] | None = None,
                  stop_request: threading.Event | None = None, *, events: RunEvents | None = None,
                  stage: StagedFolder | None = None) -> Summary:
        """One job on the pool's engines (those it starts stay in the pool for the next call); Stopped
        when `stop_request` (or `events.stop`) stopped it. `stage`: the object store's folder whose local
        copy the spec's output folder is (runner.run)."""
        notebook = events is None and shows_notebook_bar(spec.output.progress)
        if events is None:
            events = RunEvents(on_progress=on_progress, bar=notebook_bar if notebook else None)
        if stop_request is not None:
            events.stop = stop_request
        with self.runtime.calls:  # one run at a time on the process's engines (jobs/runtime.py)
            if self.sets_log_level:
                setup_log("none" if notebook else spec.output.progress)  # under a notebook's bar only warnings
            self.runtime.start(engine_log=self.engine_log)
            self.pool.drop_dead()
            try:
                summary = runner.run(spec, self.pool, events, stage=stage)
            except BaseException:  # Ctrl-C, or an engine that died: the next call must find working engines
                self.pool.drop_dead()
                raise
        if summary.status == "interrupted":
            raise Stopped(f"the run stopped at the caller's request ({events.stop_reason}): "
                          f"{summary.rows_ok} rows done, finished parts are kept", reason=events.stop_reason,
                          where=summary.output_dir, hint="run the same call again with output_dir= to resume")
        return summary


def run(data: Any, *, model: str | None = None, output_dir: str | os.PathLike[str] | None = None,
        **settings: Any) -> RunResult:
    """One job, as `qbatch run` does it (for scripts and Airflow tasks): a Session for one call.

    Takes the CLI's settings by name (engine and job settings together) and `frames=` as Session.run
    does; the engines are shut down when it returns.
    """
    engine = {k: v for k, v in settings.items() if k.replace("-", "_") in ENGINE_SETTINGS}
    job = {k: v for k, v in settings.items() if k not in engine}
    pool = EnginePool()  # one job's engines, as `qbatch run` starts them (not kept for later runs)
    try:
        with keyword_errors(), Session(model, pool=pool, **engine) as session:
            return session.run(data, output_dir=output_dir, **job)
    finally:
        pool.close_all()


# Settings that choose the input's rows or columns: the quick paths' rows are their own.
QUICK_PATH_REFUSED = ("format", "shape", "prompt_column", "messages_column", "id_column", "template", "limit", "shard",
                      "dry_run", "frames")
QUICK_PATH_HINT = "session.run(rows, ...) takes it and returns the results frame"


def _quick_values(column: str, values: Any, settings: dict[str, Any]) -> list[Any]:
    """A quick path's values as a list, checked (Session.replies): one a row (not one string, nor one
    conversation), settings that keep one row a value and one answer a row."""
    from qbatch.errors import InputError

    one = "generate([text]) for one prompt" if column == "prompt" else "chat([conversation]) for one conversation"
    what = "prompts" if column == "prompt" else "conversations"
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise InputError(f"expected a list of {what}, got {type(values).__name__}", hint=one)
    for key, value in settings.items():
        name = key.replace("-", "_")
        if name in QUICK_PATH_REFUSED:
            raise SpecError(f"{name} does not apply to the quick paths (generate, chat, replies): they make "
                            "their own rows, one a value", where=f"{name}=", hint=QUICK_PATH_HINT)
        if name == "n" and isinstance(value, int) and value > 1:
            raise SpecError(f"n={value} asks for {value} answers a prompt; the quick paths return one",
                            where="n=", hint="session.run(rows, n=...) returns every sample, one result row "
                                             "each with its sample_index")
    listed = list(values)  # a list, tuple, pandas Series, generator...
    if column == "messages" and listed and all(isinstance(v, dict) for v in listed):
        raise InputError("expected a list of conversations, got one conversation (a list of messages)", hint=one)
    return listed


_REPLY_COLUMNS = ("id", "text", "reasoning", "finish_reason", "prompt_tokens", "completion_tokens")


def _texts(replies: list[Reply]) -> list[str]:
    failed = [(i, r) for i, r in enumerate(replies) if r.error is not None]
    if failed:
        from qbatch.errors import InputError

        index, reply = failed[0]
        raise InputError(f"{len(failed)} of {len(replies)} prompts failed; the first: {reply.error}: {reply.message}",
                         where=f"prompt {index}",
                         hint="session.run(...) returns the rows that worked and an errors frame")
    return [r.text or "" for r in replies]


@contextlib.contextmanager
def _output_folder(output_dir: str | os.PathLike[str] | None) -> Iterator[tuple[Path, StagedFolder | None]]:
    """The given output folder; for an object store's (`s3://...`), a local copy under the folder's lock,
    kept in step with it and uploaded when the call ends, as `qbatch run -o s3://...` works (storage/stage.py),
    and its stage; without one, a temporary folder removed afterwards."""
    if output_dir is not None and is_remote(os.fspath(output_dir)):
        with runner.staged_output(os.fspath(output_dir)) as stage:
            yield stage.path, stage
        return
    if output_dir is not None:
        if isinstance(output_dir, os.PathLike) and os.fspath(output_dir).startswith(MANGLED_URLS):
            raise SpecError(f"a Path holds a path, not a URL: {output_dir!r} lost the second slash of its scheme",
                            where="output_dir=",
                            hint="pass an object store's folder as a string: output_dir=\"s3://bucket/out\"")
        yield Path(output_dir), None
        return
    folder = Path(tempfile.mkdtemp(prefix="qbatch-session-"))
    try:
        yield folder, None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _named(output_dir: str | os.PathLike[str] | None, folder: Path) -> str | None:
    """The output folder as a call's result names it: the URL of an object store's (`folder` is its local
    copy, removed), None for a temporary one."""
    if output_dir is None:
        return None
    return os.fspath(output_dir) if is_remote(os.fspath(output_dir)) else str(folder)


def _default_engine_log() -> Path:
    """The engine log already in use in this process (a command's), else this process's session log
    in qbatch's cache: a Session's engines outlive its runs and their folders."""
    from qbatch.models.registry import cache_dir

    runtime = this_process()
    if runtime.engine_log is not None:
        return runtime.engine_log
    if runtime.session_log is None:
        runtime.session_log = vllm_output.fresh_session_log(cache_dir() / "logs")
    return runtime.session_log

