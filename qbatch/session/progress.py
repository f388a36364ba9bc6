"""A Session's progress: tqdm's notebook bar in Jupyter, the CLI's bar or log lines elsewhere."""

from __future__ import annotations

import sys
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


def reporting(on_progress: Callable[[int, int], None]) -> type[SessionProgress]:
    """A SessionProgress that calls `on_progress(rows_done, rows_failed)` after each update (a part
    written); what it raises stops the run there, at a part boundary."""

    class Reporting(SessionProgress):
        def update(self, rows: int, failed: int = 0, tokens: int = 0) -> None:
            super().update(rows, failed, tokens)
            on_progress(self.done, self.failed)

    return Reporting
