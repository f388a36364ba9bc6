"""qbatch's one log channel: the `qbatch` logger, written to stderr.

Library code logs events through `log` (engine started, engine died, warnings);
stdout is left to results and summaries. The CLI and the Python Session call
`setup()`: one handler on stderr, quiet (warnings only) with `--progress none`,
plain timestamped lines everywhere, written through tqdm when a bar is showing
so the bar is not broken. A program that embeds qbatch without `setup()` gets
the records through its own logging configuration.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import sys
from collections.abc import Callable
from typing import Any, TextIO

LOGGER_NAME = "qbatch"
log = logging.getLogger(LOGGER_NAME)
# The job a thread works for, where someone follows that job's lines (a service forwards them to the
# job's client, serve/runs.py): set in the thread that runs the job, and carried into the threads the
# job starts (`carried`), whose lines are the job's too.
current_job: contextvars.ContextVar[object | None] = contextvars.ContextVar("qbatch_job", default=None)


def carried(target: Callable[..., Any]) -> Callable[..., Any]:
    """`target`, to run in a new thread in a copy of the caller's context (its `current_job`): a thread
    otherwise starts with an empty one. One copy per thread: a context runs in one thread at a time."""
    return functools.partial(contextvars.copy_context().run, target)


class _StderrHandler(logging.Handler):
    """Writes to sys.stderr as it is at each record (test runners and notebooks swap it), through tqdm."""

    def __init__(self, stream: TextIO | None = None):
        super().__init__()
        self._stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            stream = self._stream or sys.stderr
            from tqdm import tqdm

            tqdm.write(line, file=stream)
            stream.flush()
        except Exception:  # a log line must never break a run
            self.handleError(record)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"qbatch {self.formatTime(record, '%H:%M:%S')} {prefix}{record.getMessage()}"


def setup(progress: str = "auto", *, stream: TextIO | None = None) -> None:
    """Send qbatch's records to stderr (or `stream`); INFO and up, WARNING and up with progress 'none'.
    (vLLM's own output goes to the engine log: qbatch.engines.vllm_output.)"""
    for handler in [h for h in log.handlers if isinstance(h, _StderrHandler)]:
        log.removeHandler(handler)
    handler = _StderrHandler(stream)
    handler.setFormatter(_Formatter())
    log.addHandler(handler)
    log.setLevel(logging.WARNING if progress == "none" else logging.INFO)
    log.propagate = False
