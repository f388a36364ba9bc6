"""A Session's progress: a bar in Jupyter, the CLI's bar or log lines elsewhere."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from qbatch.jobs.progress import Progress


class SessionProgress(Progress):
    """The run's Progress, with a bar in a Jupyter kernel: tqdm's widget where ipywidgets is installed,
    else its text bar, which Jupyter redraws in place.

    Jupyter's stderr is no terminal, so the CLI's `auto` would print log lines there.
    """

    def __init__(self, mode: str, total: int, *, stream: TextIO | None = None):
        notebook = shows_notebook_bar(mode)
        super().__init__("none" if notebook else mode, total, stream=stream)
        if notebook:
            self.mode = "bar"
            self._bar = _notebook_bar(total, stream)


def shows_notebook_bar(mode: str) -> bool:
    """Whether a run with this --progress mode draws its bar in a notebook here."""
    return mode in ("auto", "bar") and in_notebook()


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and "IPKernelApp" in shell.config


def _notebook_bar(total: int, stream: TextIO | None) -> Any:
    try:
        from tqdm.notebook import IProgress
    except ImportError:
        IProgress = None
    if IProgress is not None:
        from tqdm.notebook import tqdm as widget_bar

        return widget_bar(total=total, unit="row", smoothing=0.1)
    from tqdm import tqdm

    return tqdm(total=total, unit="row", file=stream or sys.stderr, smoothing=0.1)


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
