"""Checks of an uploaded batch input file, line by line, before it is stored.

A file that cannot run is refused at upload with the line that breaks it (a 400), so a batch
never starts on it; per-request problems qbatch handles itself (a prompt too long, a bad
sampling value) stay error lines in the batch's error file, as `qbatch run` records them.
The file is read by the run's own reader, so the check and the run agree on every byte.
Its texts go to API clients: they name lines and keys, never a server path or a CLI flag.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qbatch.errors import InputError
from qbatch.inputs.readers import read_rows
from qbatch.inputs.validate import EMBEDDINGS_URL, OPENAI_URLS

ENDPOINTS = (*OPENAI_URLS, EMBEDDINGS_URL)  # embeddings batches run as `qbatch embed` (worker.py)
LINE_SHAPE = 'each line is {"custom_id", "method": "POST", "url", "body"}'


def batch_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, request) of every request line, as the run reads them; InputError for a line it cannot."""
    for row in read_rows([Path(path)], fmt="jsonl", on_bad_line="skip"):
        if row.data is None:
            problem = str(row.error)  # the reader's "line is not valid JSON: ...", numbered here
            problem = f"line {row.line}{problem[4:]}" if problem.startswith("line ") else f"line {row.line}: {problem}"
            raise InputError(problem, where=f"line {row.line}", hint=f"a batch file is JSONL: {LINE_SHAPE}")
        yield row.line or 0, row.data


def check_batch_lines(path: Path, *, max_requests: int) -> tuple[int, set[str]]:
    """The number of requests and the endpoints (`url`s) they use; InputError names the first bad line.

    Requests are keyed by `custom_id` alone, as OpenAI keys them: other keys of a line (an `id` too)
    are ignored, so two lines may share an `id` but never a `custom_id`."""
    seen: set[str] = set()
    urls: set[str] = set()
    for number, request in batch_lines(path):
        where = f"line {number}"
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise InputError(f"line {number} has no custom_id (a non-empty string)", where=where,
                             hint="every request needs its own custom_id, to match its result")
        if custom_id in seen:
            raise InputError(f"duplicate custom_id {custom_id!r} on line {number}", where=where,
                             hint="custom_id must be unique within a batch file")
        seen.add(custom_id)
        if request.get("method", "POST") != "POST":
            raise InputError(f"line {number}: method must be POST, got {request.get('method')!r}", where=where)
        url = request.get("url")
        if url not in ENDPOINTS:
            raise InputError(f"line {number}: unsupported url {url!r}; supported: {', '.join(ENDPOINTS)}",
                             where=where)
        if not isinstance(request.get("body"), dict):
            raise InputError(f"line {number}: body must be an object", where=where)
        urls.add(url)
        if len(seen) > max_requests:
            raise InputError(f"the file holds more than {max_requests} requests, this service's limit", where=where,
                             hint="split it into several batches")
    if not seen:
        raise InputError("the file holds no requests", hint=f"a batch file is JSONL: {LINE_SHAPE}")
    return len(seen), urls


def lines_not_for(path: str | Path, endpoint: str, *, limit: int = 20) -> list[dict[str, object]]:
    """`BatchError`s (with line numbers) for the first requests whose url is not the batch's endpoint."""
    errors: list[dict[str, object]] = []
    for number, request in batch_lines(path):
        url = request.get("url")
        if url != endpoint:
            errors.append({"code": "invalid_url", "line": number, "param": "url",
                           "message": f"line {number}: url {url!r} is not the batch's endpoint {endpoint!r}"})
            if len(errors) >= limit:
                break
    return errors


def custom_ids(path: str | Path) -> Iterator[str]:
    """The custom_ids of a checked input file, in order."""
    for _, request in batch_lines(path):
        yield request["custom_id"]
