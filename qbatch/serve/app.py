"""The HTTP routes: OpenAI's Files and Batches APIs, `/v1/models` and `/health`, with OpenAI's error shape.

Every error is `{"error": {"message", "type", "param", "code"}}` with a 4xx status (a 500 for a
bug, logged with its traceback here and answered in the same shape, never with the traceback).
"""

from __future__ import annotations

import hmac
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from qbatch._fs import TMP_MARK, fsync_dir
from qbatch.errors import InputError
from qbatch.log import log
from qbatch.serve import objects
from qbatch.serve.config import COMPLETION_WINDOW, ServeSettings
from qbatch.serve.requests import ENDPOINTS, check_batch_lines, lines_not_for
from qbatch.serve.store import Store
from qbatch.serve.worker import BatchWorker

MAX_BATCH_PAGE = 100
MAX_FILE_PAGE = 10_000
COPY_BYTES = 1 << 20
METADATA_KEYS = 16  # OpenAI's limit on a batch's metadata pairs


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_response(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def create_app(settings: ServeSettings, store: Store, worker: BatchWorker) -> FastAPI:
    app = FastAPI(title="qbatch serve", docs_url=None, redoc_url=None, openapi_url=None)
    files_dir = settings.data_dir / "files"

    # -- errors ----------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, kind=exc.kind, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"invalid request: {first.get('msg', 'malformed')} ({param})", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return error_response(exc.status_code, str(message))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception(f"serve: {request.method} {request.url.path} failed")
        return error_response(500, "internal error; the service logged it", kind="server_error")

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        """Authentication (Bearer, constant-time compare) and the upload size, before any body is read."""
        if settings.api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
                return error_response(401, "missing or wrong API key; send Authorization: Bearer KEY",
                                      code="invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_upload_bytes + COPY_BYTES:
            return error_response(413, f"request body of {int(length)} bytes is over the limit of "
                                       f"{settings.max_upload_bytes} bytes (--max-upload-bytes)")
        return await call_next(request)

    # -- service -----------------------------------------------------------------
    @app.get("/health")
    def health() -> JSONResponse:
        status = "error" if worker.failed else "ok" if worker.ready.is_set() else "starting"
        body = {"status": status, "model": settings.model, "queued": len(store.pending())}
        if worker.failed:
            body["error"] = worker.failed
        return JSONResponse(body, status_code=503 if worker.failed else 200)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "created": 0,
                                            "owned_by": "qbatch"}]}

    # -- files ---------------------------------------------------------------------
    @app.post("/v1/files")
    async def create_file(request: Request) -> dict[str, Any]:
        try:
            form = await request.form(max_files=1, max_fields=8)
        except Exception as exc:  # malformed multipart, or not multipart at all
            raise ApiError(400, f"expected a multipart/form-data body with 'file' and 'purpose': {exc}") from None
        purpose, upload = form.get("purpose"), form.get("file")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "no file in the form's 'file' field (multipart/form-data)", param="file")
        if purpose != "batch":
            raise ApiError(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
        record = await run_in_threadpool(_store_upload, upload.file, upload.filename or "upload.jsonl")
        store.add_file(record)
        log.info(f"serve: file {record['id']} uploaded ({record['num_requests']} requests, {record['bytes']} bytes)")
        return objects.file_object(record)

    def _store_upload(source: Any, filename: str) -> dict[str, Any]:
        """Copy the upload to disk within the size limit, check its lines, then rename it into place."""
        file_id = objects.new_file_id()
        files_dir.mkdir(parents=True, exist_ok=True)
        final = files_dir / f"{file_id}.jsonl"
        tmp = files_dir / f"{file_id}.jsonl{TMP_MARK}{os.getpid()}"
        try:
            size = 0
            with open(tmp, "wb") as handle:
                while chunk := source.read(COPY_BYTES):
                    size += len(chunk)
                    if size > settings.max_upload_bytes:
                        raise ApiError(413, f"file is over the limit of {settings.max_upload_bytes} bytes "
                                            "(--max-upload-bytes)", param="file")
                    handle.write(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            with open(tmp, "rb") as handle:
                try:
                    num_requests, _ = check_batch_lines(handle, max_requests=settings.max_requests)
                except InputError as exc:
                    raise ApiError(400, exc.message + (f"; {exc.hint}" if exc.hint else ""), param="file",
                                   code="invalid_file") from None
            os.replace(tmp, final)
            fsync_dir(files_dir)
        finally:
            tmp.unlink(missing_ok=True)
        return {"id": file_id, "purpose": "batch", "filename": Path(filename).name[:255], "bytes": size,
                "created_at": objects.now(), "path": str(final), "num_requests": num_requests}

    @app.get("/v1/files")
    def list_files(purpose: str | None = None, limit: int = MAX_FILE_PAGE, after: str | None = None) -> dict[str, Any]:
        if after is not None:
            _check_id(after, objects.FILE_ID, "after")
        rows, more = store.files(purpose=purpose, limit=max(1, min(limit, MAX_FILE_PAGE)), after=after)
        return objects.page([objects.file_object(r) for r in rows], more)

    @app.get("/v1/files/{file_id}")
    def retrieve_file(file_id: str) -> dict[str, Any]:
        return objects.file_object(_file(file_id))

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str) -> FileResponse:
        record = _file(file_id)
        return FileResponse(record["path"], media_type="application/octet-stream", filename=record["filename"])

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str) -> dict[str, Any]:
        record = _file(file_id)
        readers = store.batches_reading(file_id)
        if readers:
            raise ApiError(409, f"file {file_id} is the input of batch {readers[0]}, which has not finished",
                           param="file_id")
        store.delete_file(file_id)
        Path(record["path"]).unlink(missing_ok=True)
        log.info(f"serve: file {file_id} deleted")
        return {"id": file_id, "object": "file", "deleted": True}

    def _file(file_id: str) -> dict[str, Any]:
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
        if source["purpose"] != "batch":
            raise ApiError(400, f"file {input_file_id} has purpose {source['purpose']!r}, not 'batch'",
                           param="input_file_id")
        batch = objects.new_batch(input_file_id, endpoint, window, settings.window_s, metadata, settings.model)
        store.add_batch(batch)
        log.info(f"serve: batch {batch['id']} validating (file {input_file_id})")
        errors = await run_in_threadpool(lines_not_for, source["path"], endpoint)
        if errors:
            batch = store.update_batch(batch["id"], {"status": "failed", "failed_at": objects.now(),
                                                     "errors": objects.batch_errors(errors)})
            log.info(f"serve: batch {batch['id']} failed ({len(errors)} lines for another endpoint)")
            return batch
        counts = {"total": source["num_requests"], "completed": 0, "failed": 0}
        batch = store.update_batch(batch["id"], {"status": "in_progress", "in_progress_at": objects.now(),
                                                 "request_counts": counts})
        log.info(f"serve: batch {batch['id']} in_progress (queued, {counts['total']} requests)")
        worker.wake()
        return batch

    @app.get("/v1/batches")
    def list_batches(limit: int = 20, after: str | None = None) -> dict[str, Any]:
        if after is not None:
            _check_id(after, objects.BATCH_ID, "after")
        rows, more = store.batches(limit=max(1, min(limit, MAX_BATCH_PAGE)), after=after)
        return objects.page(rows, more)

    @app.get("/v1/batches/{batch_id}")
    def retrieve_batch(batch_id: str) -> dict[str, Any]:
        return _batch(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> dict[str, Any]:
        _batch(batch_id)
        return worker.cancel(batch_id)

    def _batch(batch_id: str) -> dict[str, Any]:
        return _lookup(batch_id, objects.BATCH_ID, "batch_id", store.batch, "batch")

    return app


def _lookup(value: str, pattern: re.Pattern[str], param: str, find: Callable[[str], dict[str, Any] | None],
            what: str) -> dict[str, Any]:
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
