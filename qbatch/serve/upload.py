"""Receiving an uploaded file: the multipart body streamed straight to a temporary file in the data folder.

The body is parsed as it arrives, and reading stops the moment the file passes the size limit
(a 413 at once, whether the client sent a Content-Length or streamed the body in chunks). At most
MAX_UPLOADS uploads are received at once (another waits, then gets a 429, which the `openai` SDK
retries), so the uploads in flight hold at most MAX_UPLOADS x the limit of disk, all of it in the
data folder.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from qbatch.serve.objects import ApiError

MAX_UPLOADS = 4
MAX_PARTS = 8
MAX_FIELD_BYTES = 1024  # a text field of the form (`purpose`)
FORM_BYTES = 64 * 1024  # what a body may hold besides the file: part headers, boundaries, text fields
WAIT_S = 30.0  # how long an upload waits for a slot
RETRY_AFTER_S = 5
FORM_HINT = "send a multipart/form-data body with 'file' and 'purpose' (the openai SDK's files.create does)"


@dataclass
class Form:
    """An upload's form: its text fields, and its file's name and size (the bytes are on disk)."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    file_bytes: int = 0


class UploadSlots:
    """At most `limit` uploads received at once: another waits for a slot (its body unread, holding no
    disk), and after WAIT_S is refused with a 429."""

    def __init__(self, limit: int = MAX_UPLOADS):
        self.limit = limit
        self._free = asyncio.Semaphore(limit)

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        try:
            await asyncio.wait_for(self._free.acquire(), WAIT_S)
        except TimeoutError:
            raise ApiError(429, f"{self.limit} uploads are being received already; retry in a moment",
                           kind="requests", code="rate_limit_exceeded",
                           headers={"retry-after": str(RETRY_AFTER_S)}) from None
        try:
            yield
        finally:
            self._free.release()


async def receive_form(request: Request, path: Path, *, max_file_bytes: int) -> Form:
    """Parse the body as it arrives, the file's bytes written to `path` (fsynced); ApiError when it is not a
    form with one file, or the moment the file passes `max_file_bytes`."""
    parts = _Parts(max_file_bytes)
    parser = MultipartParser(_boundary(request.headers.get("content-type", "")), parts.callbacks())
    body_bytes = 0
    with open(path, "wb") as handle:
        try:
            async for chunk in request.stream():
                body_bytes += len(chunk)
                if body_bytes > max_file_bytes + FORM_BYTES:
                    raise too_large(max_file_bytes)
                parser.write(chunk)
                if parts.pending:
                    data, parts.pending = b"".join(parts.pending), []
                    await run_in_threadpool(handle.write, data)
            parser.finalize()
        except MultipartParseError as exc:
            raise ApiError(400, f"the body is not a valid multipart form: {exc}; {FORM_HINT}") from None
        except ClientDisconnect:
            raise ApiError(400, "the client went away before the body's end") from None
        if parts.open_part:
            raise ApiError(400, f"the body ended inside a part of the form; {FORM_HINT}")
        await run_in_threadpool(_sync, handle)
    return parts.form


def too_large(max_file_bytes: int) -> ApiError:
    return ApiError(413, f"the file is over this service's limit of {max_file_bytes} bytes; split it into "
                         "several batches", param="file", code="file_too_large")


def _sync(handle: Any) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def _boundary(content_type: str) -> bytes:
    kind, params = parse_options_header(content_type)
    if kind != b"multipart/form-data" or not params.get(b"boundary"):
        raise ApiError(400, f"expected a multipart/form-data body, got {kind.decode('latin-1') or 'none'!r}; "
                            f"{FORM_HINT}", param="file")
    return params[b"boundary"]


class _Parts:
    """python-multipart's callbacks: text fields kept (small), the file's bytes queued in `pending` for the
    caller to write, every limit checked as the bytes arrive."""

    def __init__(self, max_file_bytes: int):
        self.form = Form()
        self.max_file_bytes = max_file_bytes
        self.pending: list[bytes] = []
        self.open_part = False
        self._count = 0
        self._headers: dict[bytes, bytes] = {}
        self._header = [b"", b""]
        self._name = ""
        self._is_file = False
        self._text = bytearray()

    def callbacks(self) -> MultipartCallbacks:
        return {"on_part_begin": self._begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_done, "on_part_data": self._data, "on_part_end": self._end}

    def _begin(self) -> None:
        self._count += 1
        if self._count > MAX_PARTS:
            raise ApiError(400, f"the form has more than {MAX_PARTS} parts; {FORM_HINT}")
        self.open_part = True
        self._headers, self._header, self._text = {}, [b"", b""], bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header[0] += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._header[1] += data[start:end]

    def _header_end(self) -> None:
        if len(self._headers) >= MAX_PARTS:
            raise ApiError(400, f"a part of the form has more than {MAX_PARTS} headers; {FORM_HINT}")
        self._headers[self._header[0].lower()] = self._header[1]
        self._header = [b"", b""]

    def _headers_done(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        self._is_file = b"filename" in options
        if not self._is_file:
            return
        if self._name != "file" or self.form.filename is not None:
            raise ApiError(400, f"the form holds a file in field {self._name!r}; it takes one, in 'file'",
                           param="file")
        self.form.filename = options[b"filename"].decode("utf-8", "replace") or "upload.jsonl"

    def _data(self, data: bytes, start: int, end: int) -> None:
        if not self._is_file:
            self._text += data[start:end]
            if len(self._text) > MAX_FIELD_BYTES:
                raise ApiError(400, f"form field {self._name!r} is over {MAX_FIELD_BYTES} bytes", param=self._name)
            return
        self.form.file_bytes += end - start
        if self.form.file_bytes > self.max_file_bytes:
            raise too_large(self.max_file_bytes)
        self.pending.append(data[start:end])

    def _end(self) -> None:
        self.open_part = False
        if not self._is_file:
            self.form.fields[self._name] = self._text.decode("utf-8", "replace")
