"""qbatch: offline batch inference for small LLMs on vLLM.

`qbatch.Session` and `qbatch.run(...)` are the Python door (qbatch/session/); they load on
first use, so `import qbatch` (and the CLI's --help) imports neither polars nor the engine.
"""

from __future__ import annotations

from typing import Any

from qbatch.versions import __version__
__all__ = ["RunResult", "Session", "__version__", "run"]


def run(data: Any, **settings: Any) -> Any:
    """Run one job on a Session of its own and close it: `qbatch run` from Python (see qbatch.session.run)."""
    from qbatch.session.session import run as run_job

    return run_job(data, **settings)


def __getattr__(name: str) -> object:
    if name in ("Session", "RunResult"):
        from qbatch.session import session

        return getattr(session, name)
    raise AttributeError(f"module 'qbatch' has no attribute {name!r}")
