"""Jobs handed to the service by `qbatch run --server` (and `qbatch embed --server`): checked, then run on
the warm engines through the worker's Session (`run_spec`, hence `runner.run`), the run's log lines, bar
and summary streamed back (wire.py).

The request names paths on this host, so it is taken from loopback clients only (whatever address the
service binds), with the service's API key when it has one. The job is the client's: its inputs, its
output folder, its settings; the service's own job defaults (`qbatch serve --max-tokens`, ...) are for
batches and do not apply, so the results are those of the same command run without --server. Its engine
settings are the service's: one the job gives must be the service's value. Before anything runs, an output
folder this process's user cannot create or write, and an input it cannot read, are refused by path; the
run writes in the output folder only (vLLM's own output goes to the service's engine log).

Runs take the engines one at a time with the queue's batches (the Session's lock): a job waits for the
batch running, the next batch for the job. A client that goes away (Ctrl-C, killed) stops its run within
about two seconds (heartbeats find it gone; the run's stop request is set); the finished parts stay and
the same command resumes, with or without --server.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi.responses import StreamingResponse

from qbatch._fs import OUTPUT_LOCK, OpenFolder, output_error, private_folder
from qbatch.errors import EXIT_ENGINE, EXIT_USAGE, QbatchError, SpecError, Stopped
from qbatch.jobs.events import RunEvents, StopRequest
from qbatch.output.summary import exit_code
from qbatch.log import current_job, log
from qbatch.serve import sockets
from qbatch.serve.config import ServeSettings, is_loopback
from qbatch.serve.objects import ApiError
from qbatch.serve.wire import FOLDER_SETTINGS, HEARTBEAT_S, ErrorInfo, RunEnd, RunRequest, canonical, line
from qbatch.serve.worker import BatchWorker
from qbatch.spec import ENGINE_SETTINGS, JOB_OWN_ENGINE_SETTINGS, LORA_SETTINGS, JobSpec
from qbatch.versions import __version__

BAR_EVERY_S = 0.25  # the bar's state goes to the client at most this often (and when it closes)
SERVER_HINT = "run it without --server, or start a service with that setting"


class RunRefused(ApiError):
    """A job refused before it runs: OpenAI's error shape plus what the CLI prints and its exit code."""

    def __init__(self, status: int, error: ErrorInfo, *, code: str | None = None):
        super().__init__(status, error.message, code=code)
        self.error = error

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"].update(self.error.fields())
        return body


def refused(status: int, message: str, *, where: str | None = None, hint: str | None = None,
            exit: int = EXIT_USAGE, code: str | None = None) -> RunRefused:
    return RunRefused(status, ErrorInfo(message, exit, where, hint), code=code)


# -- checks, before anything runs ------------------------------------------------------------------
def check_client(host: str | None, *, port: int | None = None, server_port: int | None = None,
                 keyed: bool = False, server_host: str | None = None) -> None:
    """Loopback clients only: a job names files on this machine, and what they hold goes back. Without an API
    key, clients of the service's own user only, on every route but /health (app.py): another user's job would
    read and write files with the service's rights, and the batches hold what the service's user uploaded.
    The client's user is the owner of its socket, where the system says (Linux: sockets.py); where it does not,
    the request is refused (fail closed): an address is no proof of a user, a header less still. `server_host`:
    the address the client connected to (the request's own), else the client's (loopback to loopback)."""
    if not is_loopback(host or ""):
        raise refused(403, f"jobs are taken from this machine only (127.0.0.1, ::1); the request came from {host}",
                      hint="run the command on the service's host, or without --server", code="not_loopback")
    if keyed:
        return
    uid = sockets.owner((host or "", port), (server_host or host or "", server_port)) if port and server_port else None
    if uid is None:
        raise refused(403, "the service cannot tell which user the request comes from (the system does not name "
                      "the owner of the client's socket); a service without an API key serves its own user only",
                      hint=f"start `qbatch serve` with {KEY_HINT}", code="unknown_user")
    if uid != os.getuid():
        raise refused(403, f"the request comes from another user (uid {uid}) than the service's ({_user()}); a "
                      "service without an API key serves its own user only",
                      hint=f"start `qbatch serve` with {KEY_HINT}, or run without --server", code="other_user")


KEY_HINT = "--api-key KEY (or QBATCH_API_KEY) and pass the same key"


def accept(body: Any, settings: ServeSettings, worker: BatchWorker) -> tuple[JobSpec, bool]:
    """The job's spec (and whether the client draws a bar), every check passed; a RunRefused says why not."""
    try:
        request = RunRequest.from_json(body)
    except ValueError as exc:
        raise refused(400, str(exc)) from None
    if request.qbatch_version != __version__:
        raise refused(409, f"the service runs qbatch {__version__}, this client qbatch {request.qbatch_version}",
                      hint="run both from one install (restart `qbatch serve` after an upgrade), or drop --server",
                      code="version_mismatch")
    if worker.failed:
        raise refused(503, f"the service's engines did not start ({worker.failed})", exit=EXIT_ENGINE,
                      hint="the service's log says why; run without --server meanwhile", code="engines_failed")
    try:
        spec = spec_for(request.values, settings)
        check_paths(spec, settings.data_dir)
    except QbatchError as exc:
        raise RunRefused(403 if isinstance(exc, PathRefused) else 400, ErrorInfo.of(exc)) from None
    return spec, request.bar


def spec_for(values: dict[str, Any], settings: ServeSettings) -> JobSpec:
    """The client's settings on the service's engine: an engine setting the job gives must be the service's
    (then the service's spelling is kept: the same engine, warm). The job's own engine settings (its seed, its
    adapters: JOB_OWN_ENGINE_SETTINGS) are the job's, given or not; the service's job defaults do not apply."""
    source = "--server job"
    values = canonical(values)
    engine = {name: value for name, value in settings.engine.items() if name not in JOB_OWN_ENGINE_SETTINGS}
    service = JobSpec.from_flat(settings.engine, source="qbatch serve").engine
    asked = JobSpec.from_flat({**engine, **values}, source=source).engine
    job = dict(values)
    if _same("lora", service.lora, asked.lora):  # the service's adapters, spelled its way: its warm engine
        job.update({name: value for name, value in settings.engine.items() if name in LORA_SETTINGS})
    for name in (ENGINE_SETTINGS - JOB_OWN_ENGINE_SETTINGS) & set(values):
        if name == "task":  # an embedding job gets an engine of its own, as /v1/embeddings batches do
            continue
        have, want = getattr(service, name), getattr(asked, name)
        if not _same(name, have, want):
            raise SpecError(f"the service runs {name} {have!r}; this job asks for {want!r}", where=source,
                            hint=SERVER_HINT)
        job.pop(name)
    return JobSpec.from_flat({**engine, **job}, source=source)


def _same(name: str, have: Any, want: Any) -> bool:
    if have == want:
        return True
    if name in FOLDER_SETTINGS and isinstance(have, str) and isinstance(want, str):
        return _folder(have) is not None and _folder(have) == _folder(want)
    if name == "lora" and isinstance(have, dict) and isinstance(want, dict) and have.keys() == want.keys():
        return all(_folder(have[k]) is not None and _folder(have[k]) == _folder(want[k]) for k in have)
    return False


def _folder(value: str) -> Path | None:
    path = Path(value).expanduser()
    return path.resolve() if path.is_dir() else None


class PathRefused(QbatchError):
    """A path of the job the service's user may not use, or must not write."""

    exit_code = EXIT_USAGE


def check_paths(spec: JobSpec, data_dir: Path) -> None:
    """Before anything runs: absolute paths only (the client's), an output folder this user can create or
    write outside the service's data folder, inputs it can read. Globs and missing files are the run's to
    report, as a local run does."""
    out = spec.output.output_dir
    if not out and not spec.output.dry_run:  # a dry run writes nothing
        raise SpecError("no output folder given", hint="pass -o/--output-dir OUT_DIR")
    relative = next((p for p in [out or "/", *spec.input.inputs] if not os.path.isabs(p)), None)
    if relative is not None:
        raise PathRefused("paths sent to the service must be absolute (a client names them from its own folder)",
                          where=relative, hint="update qbatch on the client, or drop --server")
    _check_inputs(spec.input.inputs)
    if out:
        _check_output(Path(out), data_dir)


def _check_output(folder: Path, data_dir: Path) -> None:
    out = str(folder)
    if folder.resolve().is_relative_to(data_dir.resolve()):
        raise PathRefused("the output folder is inside the service's own data folder", where=out,
                          hint="pass another -o/--output-dir")
    if folder.is_dir() and os.getuid() != 0 and folder.stat().st_uid != os.getuid():
        raise PathRefused(f"the output folder belongs to another user than the service's ({_user()}), who makes a "
                          "job's output folder private to itself", where=out,
                          hint="pass an -o/--output-dir that does not exist yet, or run without --server")
    existing = _nearest_existing(folder)
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        raise PathRefused(f"the service's user ({_user()}) cannot write here", where=str(existing),
                          hint="pass an -o/--output-dir the service may write, or run without --server")


def _check_inputs(inputs: list[str]) -> None:
    for item in inputs:
        path = Path(item)
        mode = os.R_OK | os.X_OK if path.is_dir() else os.R_OK
        if path.exists() and not os.access(path, mode):
            raise PathRefused(f"the service's user ({_user()}) cannot read this input", where=item,
                              hint="make it readable to that user, or run without --server")


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


# -- the run ------------------------------------------------------------------------------------------
class ClientRun:
    """One job on the worker's Session in a thread of its own; its lines go to the response through an
    asyncio queue (the service's event loop)."""

    def __init__(self, spec: JobSpec, bar: bool, worker: BatchWorker, loop: asyncio.AbstractEventLoop):
        self.spec, self.worker, self.loop = spec, worker, loop
        self.stop = StopRequest()
        # stream: a run deciding "auto" never draws a bar on the service's own terminal
        self.events = RunEvents(bar=self._bar if bar else None, stream=io.StringIO(), stop=self.stop)
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._work, name="qbatch-serve-client-run", daemon=True)

    def response(self) -> StreamingResponse:
        self.thread.start()
        return _Stream(self._lines(), on_close=self._client_gone, media_type="application/x-ndjson")

    async def _lines(self) -> AsyncIterator[bytes]:
        while True:
            try:
                item = await asyncio.wait_for(self.queue.get(), HEARTBEAT_S)
            except TimeoutError:
                item = {}  # a heartbeat: writing it is how a client gone away is found
            if item is None:
                return
            yield line(item)

    def _client_gone(self) -> None:
        if not self.finished.is_set():
            log.info(f"serve: the client of the run into {self.spec.output.output_dir} went away: stopping it")
            self.stop.request("client gone")

    def _put(self, item: dict[str, Any] | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the service is stopping
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _work(self) -> None:
        spec = self.spec
        log.info(f"serve: running a job for a client into {spec.output.output_dir}")
        made = False
        try:
            with self.worker.client_run(self.stop), _forwarded_logs(self._put):
                self._wait_for_engines()
                made = not spec.output.dry_run and _private_output(spec.output.output_dir)
                summary = self.worker.session.run_spec(spec, self.events)
            code = exit_code(summary, fail_on_row_errors=spec.output.fail_on_row_errors,
                             max_unusable=spec.output.max_unusable)
            self._put(RunEnd(summary, code).save())
        except Stopped as exc:
            self._put({"error": _stopped(exc).fields()})
        except QbatchError as exc:
            if made and spec.output.output_dir:  # a run refused before it wrote anything leaves no folder, as a local one does
                with contextlib.suppress(OSError):
                    Path(spec.output.output_dir).rmdir()
            self._put({"error": ErrorInfo.of(exc).fields()})
        except Exception:  # noqa: BLE001 - a bug: logged here, the client told where to look
            log.exception(f"serve: the run into {spec.output.output_dir} failed")
            self._put({"error": ErrorInfo("internal error in the qbatch service; its log says why", 1).fields()})
        finally:
            self.finished.set()
            self._put(None)

    def _wait_for_engines(self) -> None:
        if not self.worker.ready.is_set():
            log.info("waiting for the service's engines to start")
        while not self.worker.ready.wait(0.2):
            if self.worker.failed:
                raise QbatchError(f"the service's engines did not start ({self.worker.failed})",
                                  hint="the service's log says why; run without --server meanwhile")
            if self.stop.is_set():
                raise Stopped("stopped before it started", reason=self.stop.reason)

    def _bar(self, total: int) -> _RemoteBar:
        return _RemoteBar(total, self._put)


def _private_output(output_dir: str | None) -> bool:
    """The job's output folder, made private to the service's user (0700) before its run writes in it: what the
    run writes there was read with that user's rights. Whether it was created."""
    if not output_dir or os.path.exists(output_dir) and not os.path.isdir(output_dir):
        return False  # the run names what is wrong with a path that is no folder
    try:
        return private_folder(Path(output_dir), marker=OUTPUT_LOCK)
    except OpenFolder as exc:
        raise PathRefused(f"the output folder holds other files and is open to other users (mode {exc.mode:04o}); "
                          "the service makes a job's output folder private to its user", where=output_dir,
                          hint="pass a new -o/--output-dir, or run without --server") from None
    except OSError as exc:
        raise output_error("make the output folder private to the service's user", Path(output_dir), exc) from None


def _stopped(exc: Stopped) -> ErrorInfo:
    if exc.reason == "shutdown":
        return ErrorInfo(f"the qbatch service is shutting down: {exc.message}", EXIT_ENGINE, exc.where,
                         "rerun the same command to resume, once the service is back or without --server")
    return ErrorInfo(exc.message, 1, exc.where, exc.hint)


class _RemoteBar:
    """tqdm's interface as the run's Progress uses it (a caller's own bar, events.py), drawn by the client."""

    def __init__(self, total: int, put: Callable[[dict[str, Any]], None]):
        self.total, self.n, self.postfix, self._put, self._sent = total, 0, "", put, 0.0
        self._send()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self._sent >= BAR_EVERY_S:
            self._send()

    def close(self) -> None:
        self._send()

    def _send(self) -> None:
        self._sent = time.monotonic()
        self._put({"progress": {"total": self.total, "done": self.n, "postfix": self.postfix}})


class _Forward(logging.Handler):
    """qbatch's log lines of a client's run, to the client: those of the thread running it (the runner, its
    progress, the pool) and of the threads the run started (its reading and encoding: log.current_job), not
    the lines of a batch or another job running meanwhile, nor the service's own (`serve: ...`). The
    service's log level (its --progress) bounds which lines there are."""

    def __init__(self, put: Callable[[dict[str, Any]], None]):
        super().__init__()
        self._put = put
        self.job = object()

    def emit(self, record: logging.LogRecord) -> None:  # in the thread that logs: its context says whose
        message = record.getMessage()
        if current_job.get() is self.job and not message.startswith("serve:"):
            self._put({"log": {"level": record.levelno, "message": message}})


@contextlib.contextmanager
def _forwarded_logs(put: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """The qbatch log lines of the calling thread and of the threads it starts go to `put` too."""
    handler = _Forward(put)
    token = current_job.set(handler.job)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        current_job.reset(token)


class _Stream(StreamingResponse):
    """A streaming response that says when it ends, however it ends (a client gone away included)."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], None], media_type: str):
        super().__init__(content, media_type=media_type)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
