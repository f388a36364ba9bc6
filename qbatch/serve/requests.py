"""Checks of an uploaded batch input file, line by line, before it is stored.

A file that cannot run is refused at upload with the line that breaks it (a 400), so a batch
never starts on it; per-request problems qbatch handles itself (a prompt too long, a bad
sampling value) stay error rows in the batch's error file, as `qbatch run` records them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from qbatch.errors import InputError
from qbatch.inputs.validate import EMBEDDINGS_URL, OPENAI_URLS

ENDPOINTS = (*OPENAI_URLS, EMBEDDINGS_URL)  # embeddings batches run as `qbatch embed` (worker.py)


def check_batch_lines(lines: Iterable[bytes], *, max_requests: int) -> tuple[int, set[str]]:
    """The number of requests and the endpoints (`url`s) they use; InputError names the first bad line."""
    seen: set[str] = set()
    urls: set[str] = set()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"line {number}"
        try:
            request = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputError(f"line {number} is not JSON: {exc}", where=where,
                             hint="a batch file is JSONL: one request object per line") from None
        if not isinstance(request, dict):
            raise InputError(f"line {number} is not a JSON object", where=where,
                             hint="each line is {\"custom_id\", \"method\", \"url\", \"body\"}")
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
            raise InputError(f"the file holds more than {max_requests} requests", where=where,
                             hint="split it, or start the service with a larger --max-requests")
    if not seen:
        raise InputError("the file holds no requests", hint="a batch file is JSONL: one request object per line")
    return len(seen), urls


def lines_not_for(path: str, endpoint: str, *, limit: int = 20) -> list[dict[str, object]]:
    """`BatchError`s (with line numbers) for the first requests whose url is not the batch's endpoint."""
    errors: list[dict[str, object]] = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            url = json.loads(raw).get("url")
            if url != endpoint:
                errors.append({"code": "invalid_url", "line": number, "param": "url",
                               "message": f"line {number}: url {url!r} is not the batch's endpoint {endpoint!r}"})
                if len(errors) >= limit:
                    break
    return errors
