"""Ids and the OpenAI objects (`openai.types.FileObject`, `Batch`, `BatchRequestCounts`, `BatchUsage`,
`BatchError`) and OpenAI's error shape.

Ids are random (`file-<hex>`, `batch_<hex>`) and checked against their pattern before any lookup:
an id is a key in the store, never a path. Texts sent to API clients name lines, keys and settings,
never a server path or a CLI flag (`client_text`): the client cannot see the one nor pass the other.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal

FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
BATCH_ID = re.compile(r"^batch_[0-9a-f]{24}$")
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
# Statuses after which a batch never changes again.
TERMINAL: frozenset[BatchStatus] = frozenset({"completed", "failed", "expired", "cancelled"})
# Statuses the worker still has to act on, after a restart too.
PENDING: tuple[BatchStatus, ...] = ("in_progress", "cancelling", "finalizing")


# A CLI flag in a message (`--max-model-len`), and a clause (after "; ") that tells the CLI user what to run.
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
COMMAND = re.compile(r"`qbatch\b|`--")


class ApiError(Exception):
    """An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def client_text(message: str) -> str:
    """A run's message as an API client reads it: the clauses that tell a CLI user which flag to pass or
    what to run are left out, and a flag the message's first clause names becomes the setting's name
    (`--max-model-len` -> `max_model_len`): the client cannot pass flags to the service."""
    first, *rest = message.split("; ")
    kept = [FLAG.sub(lambda m: m.group(1).replace("-", "_"), first)]
    kept += [clause for clause in rest if not FLAG.search(clause) and not COMMAND.search(clause)]
    return "; ".join(kept)


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


@dataclass(frozen=True)
class StoredFile:
    """A file the service holds, as its store records it (`path` and `num_requests` are the service's own)."""

    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    path: str
    num_requests: int | None

    def openai(self) -> dict[str, Any]:
        """As `openai.types.FileObject`."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None, "status_details": None}


@dataclass(frozen=True)
class RequestCounts:
    """`Batch.request_counts` (`BatchRequestCounts`)."""

    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass(frozen=True, kw_only=True)
class Batch:
    """An `openai.types.Batch`, as the store holds it and the API answers it (`save`: its JSON object, the
    fields in OpenAI's order)."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str
    errors: dict[str, Any] | None = None  # batch_errors()
    input_file_id: str
    completion_window: str
    status: BatchStatus = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    usage: dict[str, Any] = field(default_factory=lambda: usage())

    @classmethod
    def load(cls, data: dict[str, Any]) -> Batch:
        return cls(**{**data, "request_counts": RequestCounts(**data["request_counts"])})

    def save(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def changed(self, status: BatchStatus | None = None, **changes: Any) -> Batch:
        """The batch with `changes`; with `status`, at its time now (`<status>_at`, where the object has one)."""
        if status is not None:
            changes["status"] = status
            if hasattr(self, f"{status}_at"):
                changes[f"{status}_at"] = now()
        return dataclasses.replace(self, **changes)


def new_batch(input_file_id: str, endpoint: str, completion_window: str, window_s: float,
              metadata: dict[str, str] | None, model: str) -> Batch:
    """A new batch, status `validating`."""
    created = now()
    return Batch(id=new_batch_id(), endpoint=endpoint, model=model, input_file_id=input_file_id,
                 completion_window=completion_window, created_at=created, expires_at=created + int(window_s),
                 metadata=metadata)


def usage(input_tokens: int = 0, output_tokens: int = 0, cached_tokens: int = 0) -> dict[str, Any]:
    """`Batch.usage` (`BatchUsage`). qbatch does not count a thinking model's reasoning tokens apart
    from its answer's: they are in output_tokens, and reasoning_tokens is 0."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def batch_errors(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """`Batch.errors`: a list of `BatchError` (code, message, param, line)."""
    return {"object": "list", "data": [{"code": e.get("code"), "message": e.get("message"), "param": e.get("param"),
                                        "line": e.get("line")} for e in errors]}


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A cursor page, as the SDK's `SyncCursorPage` reads it (`after` = the last id)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
