"""A Session's progress bar in Jupyter: Jupyter's stderr is no terminal, so the CLI's `auto` would
print log lines there; the run draws this bar instead (RunEvents.bar)."""

from __future__ import annotations

import sys
from typing import Any


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


def notebook_bar(total: int) -> Any:
    """tqdm's widget where ipywidgets is installed, else its text bar, which Jupyter redraws in place."""
    try:
        from tqdm import notebook

        widgets = getattr(notebook, "IProgress", None) is not None  # tqdm's None where ipywidgets is missing
    except ImportError:
        widgets = False
    if widgets:
        from tqdm.notebook import tqdm as widget_bar

        return widget_bar(total=total, unit="row", smoothing=0.1)
    from tqdm import tqdm

    return tqdm(total=total, unit="row", file=sys.stderr, smoothing=0.1)
