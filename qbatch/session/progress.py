"""A Session's progress: tqdm's notebook bar in Jupyter, the CLI's bar or log lines elsewhere."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from qbatch.jobs.progress import Progress


class SessionProgress(Progress):
    """The run's Progress, drawing the bar with tqdm.notebook when a Jupyter kernel shows it.

    Jupyter's stderr is no terminal, so the CLI's `auto` would print log lines there.
    """

    def __init__(self, mode: str, total: int, *, stream: TextIO | None = None):
        notebook = mode in ("auto", "bar") and in_notebook()
        super().__init__("none" if notebook else mode, total, stream=stream)
        if notebook:
            from tqdm.notebook import tqdm

            self.mode = "bar"
            self._bar = tqdm(total=total, unit="row", smoothing=0.1)


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel that can draw tqdm's notebook bar (needs ipywidgets)."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or "IPKernelApp" not in shell.config:
        return False
    try:
        from tqdm.notebook import IProgress
    except ImportError:
        return False
    return IProgress is not None


# A Session's on_progress runs about this often as rows finish (and once all are done): `qbatch serve`
# writes the counts to its database each time.
ON_PROGRESS_S = 1.0


def reporting(on_progress: Callable[[int, int], None]) -> type[SessionProgress]:
    """A SessionProgress that calls `on_progress(rows_done, rows_failed)` as rows finish, every
    ON_PROGRESS_S and when the last is done; what it raises stops the run there (the rows finished
    by then are written first)."""

    class Reporting(SessionProgress):
        _reported = 0.0

        def update(self, rows: int, failed: int = 0, tokens: int = 0) -> None:
            super().update(rows, failed, tokens)
            now = time.monotonic()
            if now - self._reported >= ON_PROGRESS_S or self.done >= self.total:
                self._reported = now
                on_progress(self.done, self.failed)

    return Reporting
