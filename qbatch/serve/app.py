"""The HTTP routes: OpenAI's Files and Batches APIs, `/v1/models` and `/health`, with OpenAI's error shape.

Every error is `{"error": {"message", "type", "param", "code"}}` with a 4xx status (a 500 for a
bug, logged with its traceback here and answered in the same shape, never with the traceback).
A route the service does not have (`POST /v1/responses`) answers a 404 that lists its routes. The
online routes (`POST /v1/chat/completions`, `/v1/completions`) are online.py's. `POST /v1/qbatch/runs`
is qbatch's own: the job of a `qbatch run --server` (runs.py).
"""

from __future__ import annotations

import asyncio
import hmac
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from qbatch._fs import TMP_MARK, fsync_dir
from qbatch.errors import InputError
from qbatch.log import log
from qbatch.serve import objects, online
from qbatch.serve.config import COMPLETION_WINDOW, ServeSettings
from qbatch.serve.objects import ApiError
from qbatch.serve.requests import ENDPOINTS, check_batch_lines, lines_not_for
from qbatch.serve.runs import ClientRun, accept, check_client
from qbatch.serve.store import Store
from qbatch.serve.upload import FORM_BYTES, UploadSlots, receive_form, too_large
from qbatch.serve.wire import RUN_ROUTE
from qbatch.serve.worker import BatchWorker

MAX_BATCH_PAGE = 100
MAX_FILE_PAGE = 10_000
METADATA_KEYS = 16  # OpenAI's limit on a batch's metadata pairs


def error_response(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return api_error_response(ApiError(status, message, kind=kind, param=param, code=code))


def api_error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(settings: ServeSettings, store: Store, worker: BatchWorker) -> FastAPI:
    app = FastAPI(title="qbatch serve", docs_url=None, redoc_url=None, openapi_url=None)
    files_dir = settings.data_dir / "files"
    remove_stale_uploads(files_dir)
    uploads = UploadSlots()

    # -- errors ----------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"invalid request: {first.get('msg', 'malformed')} ({param})", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code not in (404, 405):
            return error_response(exc.status_code, str(exc.detail))
        problem = "no route" if exc.status_code == 404 else "method not allowed:"
        return error_response(exc.status_code, f"{problem} {request.method} {request.url.path}: this service has "
                                               "OpenAI's Batch API and its online routes (chat, completions, "
                                               f"embeddings); its routes: {', '.join(routes(app))}")

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception(f"serve: {request.method} {request.url.path} failed")
        return error_response(500, "internal error; the service logged it", kind="server_error")

    app.add_middleware(Guard, settings=settings)

    # -- service -----------------------------------------------------------------
    @app.get("/health")
    def health() -> JSONResponse:
        status = "error" if worker.failed else "ok" if worker.ready.is_set() else "starting"
        body = {"status": status, "model": settings.model, "queued": len(store.pending())}
        if worker.failed:
            body["error"] = "the engines did not start; the service's log says why"
        return JSONResponse(body, status_code=503 if worker.failed else 200)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        base = {"id": settings.model, "object": "model", "created": 0, "owned_by": "qbatch"}
        # the LoRA adapters (--lora) as vLLM's server lists its --lora-modules: a batch line's body.model picks one
        adapters = [{"id": name, "object": "model", "created": 0, "owned_by": "qbatch", "parent": settings.model}
                    for name in sorted(settings.engine.get("lora") or {})]
        return {"object": "list", "data": [base, *adapters]}

    # -- jobs handed over by `qbatch run --server` (runs.py) -------------------------
    @app.post(RUN_ROUTE)
    async def client_run(request: Request) -> StreamingResponse:
        _check_user(request, keyed=bool(settings.api_key))  # before the body: it names paths
        try:
            body = await request.json()
        except Exception:
            raise ApiError(400, "the body is not JSON") from None
        spec, bar = await run_in_threadpool(accept, body, settings, worker)
        return ClientRun(spec, bar, worker, asyncio.get_running_loop()).response()

    # -- files ---------------------------------------------------------------------
    @app.post("/v1/files")
    async def create_file(request: Request) -> dict[str, Any]:
        file_id = objects.new_file_id()
        files_dir.mkdir(parents=True, exist_ok=True)
        tmp = files_dir / f"{file_id}.jsonl{TMP_MARK}{os.getpid()}"
        async with uploads.held():  # until the file is checked: a slot bounds the disk its temporary file holds
            try:
                form = await receive_form(request, tmp, max_file_bytes=settings.max_upload_bytes)
                if form.filename is None:
                    raise ApiError(400, "no file in the form's 'file' field (multipart/form-data)", param="file")
                purpose = form.fields.get("purpose")
                if purpose != "batch":
                    raise ApiError(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
                record = await run_in_threadpool(_store_upload, file_id, tmp, form.filename, form.file_bytes)
            finally:
                tmp.unlink(missing_ok=True)
        store.add_file(record)
        log.info(f"serve: file {record.id} uploaded ({record.num_requests} requests, {record.bytes} bytes)")
        return record.openai()

    def _store_upload(file_id: str, tmp: Path, filename: str, size: int) -> objects.StoredFile:
        """Check the received file's lines, then rename it into place."""
        try:
            num_requests, _ = check_batch_lines(tmp, max_requests=settings.max_requests)
        except InputError as exc:
            raise ApiError(400, exc.message + (f"; {exc.hint}" if exc.hint else ""), param="file",
                           code="invalid_file") from None
        final = files_dir / f"{file_id}.jsonl"
        os.replace(tmp, final)
        fsync_dir(files_dir)
        return objects.StoredFile(file_id, "batch", Path(filename).name[:255], size, objects.now(), str(final),
                                  num_requests)

    @app.get("/v1/files")
    def list_files(purpose: str | None = None, limit: int = MAX_FILE_PAGE, after: str | None = None) -> dict[str, Any]:
        if after is not None:
            _check_id(after, objects.FILE_ID, "after")
        rows, more = store.files(purpose=purpose, limit=max(1, min(limit, MAX_FILE_PAGE)), after=after)
        return objects.page([r.openai() for r in rows], more)

    @app.get("/v1/files/{file_id}")
    def retrieve_file(file_id: str) -> dict[str, Any]:
        return _file(file_id).openai()

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str) -> FileResponse:
        record = _file(file_id)
        return FileResponse(record.path, media_type="application/octet-stream", filename=record.filename)

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str) -> dict[str, Any]:
        record = _file(file_id)
        readers = store.batches_reading(file_id)
        if readers:
            raise ApiError(409, f"file {file_id} is the input of batch {readers[0]}, which has not finished",
                           param="file_id")
        store.delete_file(file_id)
        Path(record.path).unlink(missing_ok=True)
        log.info(f"serve: file {file_id} deleted")
        return {"id": file_id, "object": "file", "deleted": True}

    def _file(file_id: str) -> objects.StoredFile:
        return _lookup(file_id, objects.FILE_ID, "file_id", store.file, "file")

    # -- batches ---------------------------------------------------------------------
    @app.post("/v1/batches")
    async def create_batch(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except Exception:
            raise ApiError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        endpoint, window, metadata = body.get("endpoint"), body.get("completion_window"), body.get("metadata")
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"unsupported endpoint {endpoint!r}; supported: {', '.join(ENDPOINTS)}",
                           param="endpoint")
        if window != COMPLETION_WINDOW:
            raise ApiError(400, f"completion_window must be {COMPLETION_WINDOW!r}, got {window!r}",
                           param="completion_window")
        if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > METADATA_KEYS
                                     or not all(isinstance(v, str) for v in metadata.values())):
            raise ApiError(400, f"metadata must be an object of at most {METADATA_KEYS} string values",
                           param="metadata")
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str):
            raise ApiError(400, "input_file_id is required", param="input_file_id")
        source = _file(input_file_id)
        if source.purpose != "batch":
            raise ApiError(400, f"file {input_file_id} has purpose {source.purpose!r}, not 'batch'",
                           param="input_file_id")
        batch = objects.new_batch(input_file_id, endpoint, window, settings.window_s, metadata, settings.model)
        store.add_batch(batch)
        log.info(f"serve: batch {batch.id} validating (file {input_file_id})")
        errors = await run_in_threadpool(lines_not_for, source.path, endpoint)
        if errors:
            batch = store.update_batch(batch.id, lambda b: b.changed("failed", errors=objects.batch_errors(errors)))
            log.info(f"serve: batch {batch.id} failed ({len(errors)} lines for another endpoint)")
            return batch.save()
        counts = objects.RequestCounts(total=source.num_requests or 0)
        batch = store.update_batch(batch.id, lambda b: b.changed("in_progress", request_counts=counts))
        log.info(f"serve: batch {batch.id} in_progress (queued, {counts.total} requests)")
        worker.wake()
        return batch.save()

    @app.get("/v1/batches")
    def list_batches(limit: int = 20, after: str | None = None) -> dict[str, Any]:
        if after is not None:
            _check_id(after, objects.BATCH_ID, "after")
        rows, more = store.batches(limit=max(1, min(limit, MAX_BATCH_PAGE)), after=after)
        return objects.page([r.save() for r in rows], more)

    @app.get("/v1/batches/{batch_id}")
    def retrieve_batch(batch_id: str) -> dict[str, Any]:
        return _batch(batch_id).save()

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> dict[str, Any]:
        _batch(batch_id)
        batch = worker.cancel(batch_id)
        if batch is None:  # it had ended before: nothing to cancel, as OpenAI answers
            raise ApiError(409, f"Cannot cancel a batch with status '{_batch(batch_id).status}'.", param="batch_id")
        return batch.save()

    def _batch(batch_id: str) -> objects.Batch:
        return _lookup(batch_id, objects.BATCH_ID, "batch_id", store.batch, "batch")

    online.install(app, settings, worker)  # /v1/chat/completions, /v1/completions on the batches' engines
    return app


class Guard:
    """Authentication before any body is read: the API key (Bearer, constant-time compare), or without one the
    client's Unix user (runs.check_client); then the upload size. A plain ASGI middleware: Starlette's
    `@app.middleware("http")` runs each request in a task of its own and passes every response chunk (each event
    of a stream) through a queue, a cost on every online request."""

    def __init__(self, app: ASGIApp, settings: ServeSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(Request(scope))
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, request: Request) -> JSONResponse | None:
        settings = self.settings
        if settings.api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
                return error_response(401, "missing or wrong API key; send Authorization: Bearer KEY",
                                      code="invalid_api_key")
        elif request.url.path != "/health":
            try:
                _check_user(request)
            except ApiError as exc:
                return api_error_response(exc)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_upload_bytes + FORM_BYTES:
            return api_error_response(too_large(settings.max_upload_bytes))
        return None


def _check_user(request: Request, *, keyed: bool = False) -> None:
    """runs.check_client on the request's socket: its peer (never a header) and the service's port."""
    server = request.scope.get("server") or (None, None)
    check_client(request.client.host if request.client else None,
                 port=request.client.port if request.client else None, server_port=server[1], keyed=keyed,
                 server_host=server[0])


def routes(app: FastAPI) -> list[str]:
    """The service's routes, as `METHOD /path`."""
    return [f"{method} {route.path}" for route in app.routes if isinstance(route, APIRoute)
            for method in sorted(route.methods)]


def remove_stale_uploads(files_dir: Path) -> None:
    """Temporary files of uploads a stopped service was receiving (an upload's own carries a live pid)."""
    for path in files_dir.glob(f"*{TMP_MARK}*"):
        pid = path.name.rsplit(TMP_MARK, 1)[1]
        if not pid.isdigit() or not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


Stored = TypeVar("Stored", objects.Batch, objects.StoredFile)


def _lookup(value: str, pattern: re.Pattern[str], param: str, find: Callable[[str], Stored | None],
            what: str) -> Stored:
    """The stored object of a checked id, or a 404 in OpenAI's shape."""
    _check_id(value, pattern, param)
    record = find(value)
    if record is None:
        raise ApiError(404, f"no such {what}: {value}", param=param)
    return record


def _check_id(value: str, pattern: re.Pattern[str], param: str) -> None:
    """Ids are checked before any lookup: only the service's own random ids get through."""
    if not pattern.fullmatch(value):
        shown = value if len(value) <= 64 else value[:64] + "..."
        raise ApiError(400, f"{shown!r} is not a valid {param} ({pattern.pattern})", param=param)
