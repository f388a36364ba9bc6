"""What `qbatch run --server` and the service say to each other: the request, and the NDJSON lines of
the answer (RunEnd carries the Summary). No web stack: a client needs none (the `serve` extra).

The client POSTs a RunRequest to RUN_ROUTE; the service answers with one JSON object a line:
`{"log": {...}}` (a qbatch log line of the run), `{"progress": {...}}` (the bar's state, a few times a
second at most), `{}` (a heartbeat: the service finds a client that went away by writing to it), and
last either `{"summary": {...}, "exit_code": N}` or `{"error": {...}}`. A job refused before it runs
is an HTTP error whose body is `{"error": {...}}` too, in OpenAI's shape plus the qbatch fields.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from qbatch.errors import QbatchError
from qbatch.output.summary import Summary

RUN_ROUTE = "/v1/qbatch/runs"
# Engine settings that name a folder or a hub name: the client sends a folder of its own by its absolute
# path, and the service takes the job's value as its own when both are the same folder.
FOLDER_SETTINGS = ("model", "tokenizer")
HEARTBEAT_S = 1.0  # a client gone away stops its run within about this (plus the run's own second)


@dataclass(frozen=True)
class RunRequest:
    """A job for the service: the settings the user gave (job file and flags, paths absolute: the
    client's), the client's qbatch version, and whether the client draws a progress bar."""

    values: dict[str, Any]
    qbatch_version: str
    bar: bool = False

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, body: Any) -> RunRequest:
        """The request in a parsed body; ValueError says what is wrong with it."""
        if not isinstance(body, dict) or not isinstance(body.get("values"), dict):
            raise ValueError("the body must be a JSON object with a 'values' object")
        version = body.get("qbatch_version")
        if not isinstance(version, str):
            raise ValueError("the body must name the client's qbatch_version")
        return cls(body["values"], version, bool(body.get("bar", False)))


@dataclass(frozen=True)
class ErrorInfo:
    """A QbatchError as it crosses the wire: what the CLI prints of it, and its exit code."""

    message: str
    exit_code: int
    where: str | None = None
    hint: str | None = None

    @classmethod
    def of(cls, exc: QbatchError) -> ErrorInfo:
        return cls(exc.message, exc.exit_code, exc.where, exc.hint)

    @classmethod
    def load(cls, data: dict[str, Any], default_exit: int) -> ErrorInfo:
        """From an answer's `error` object (one of the service's own, or another's OpenAI-shaped one)."""
        code = data.get("exit_code")
        return cls(str(data.get("message") or "the service gave no reason"),
                   code if isinstance(code, int) else default_exit, data.get("where"), data.get("hint"))

    def fields(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunEnd:
    """The answer's last line for a run that ended: its summary, and the command's exit code."""

    summary: Summary
    exit_code: int

    def save(self) -> dict[str, Any]:
        return {"summary": asdict(self.summary), "exit_code": self.exit_code}

    @classmethod
    def load(cls, item: dict[str, Any]) -> RunEnd:
        """From the line; a newer service's summary fields are left out (Summary.load)."""
        return cls(Summary.load(item["summary"]), int(item["exit_code"]))


def canonical(values: dict[str, Any]) -> dict[str, Any]:
    """The settings by their one name (a job file may spell `output-dir` or `output_dir`, as JobSpec reads
    both): the paths among them are found, and the engine's compared, by that name."""
    return {name.replace("-", "_"): value for name, value in values.items()}


def line(item: dict[str, Any]) -> bytes:
    return (json.dumps(item, default=str) + "\n").encode()
