"""Between a run and its caller: the progress the caller hears as rows finish, and the stop it may ask for.

The CLI shows progress on stderr; a Session in a notebook draws its own bar and reports counts to
its `on_progress`; `qbatch serve` stores the counts and stops a batch that is cancelled, expires or
is shut down by setting the run's `stop`. The run looks at `stop` each time its engine reports
(engines report at least every REPORT_S, engines/base.py), writes the rows finished by then,
records itself interrupted and returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO


class StopRequest(threading.Event):
    """A stop any thread may ask for, with why (the manifest records it as the run's `interrupted_by`)."""

    reason = "stop request"

    def request(self, reason: str) -> None:
        """Stop the run, for `reason` (the first reason given stays)."""
        if not self.is_set():
            self.reason = reason
        self.set()


@dataclass
class RunEvents:
    """A run's progress for its caller, and the caller's stop.

    `on_progress(rows_done, rows_failed)`: this run's counts, about every ON_PROGRESS_S as rows
    finish and once all are done; what it raises stops the run there, as a failure would (the rows
    finished by then are written). `bar(total)`: the caller's own progress bar (tqdm's interface;
    a notebook's widget) where the run would draw tqdm's on a terminal. `stream`: where progress
    shows (default stderr). `stop`: set (from any thread) to stop the run (see the module's text);
    a threading.Event will do, a StopRequest also says why.
    """

    on_progress: Callable[[int, int], None] | None = None
    bar: Callable[[int], Any] | None = None
    stream: TextIO | None = None
    stop: threading.Event = field(default_factory=StopRequest)

    @property
    def stop_reason(self) -> str:
        """Why the run was asked to stop (StopRequest.reason)."""
        return getattr(self.stop, "reason", StopRequest.reason)
