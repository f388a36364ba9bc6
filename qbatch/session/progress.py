"""A Session's progress: a bar in Jupyter, the CLI's bar or log lines elsewhere."""

from __future__ import annotations

import sys
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


def reporting(on_progress: Callable[[int, int], None]) -> type[SessionProgress]:
    """A SessionProgress that calls `on_progress(rows_done, rows_failed)` after each update (a part
    written); what it raises stops the run there, at a part boundary."""

    class Reporting(SessionProgress):
        def update(self, rows: int, failed: int = 0, tokens: int = 0) -> None:
            super().update(rows, failed, tokens)
            on_progress(self.done, self.failed)

    return Reporting
