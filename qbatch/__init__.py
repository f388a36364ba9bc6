"""qbatch: offline batch inference for small LLMs on vLLM.

`qbatch.Session` and `qbatch.run(...)` are the Python door (qbatch/session/); they load on
first use, so `import qbatch` (and the CLI's --help) imports neither polars nor the engine.
"""

import types as _types

__version__ = "0.1.0"

from qbatch import run as _run_package  # noqa: E402  (the package of the run; its __init__ is empty)


class _RunPackage(_types.ModuleType):
    """`qbatch.run` is both the package of the run (qbatch.run.runner, ...) and, called, the
    one-job function `qbatch.session.run`: an import of qbatch.run.* rebinds the attribute
    `qbatch.run` to the package, so the package itself must be the callable."""

    def __call__(self, *args: object, **kwargs: object) -> object:
        from qbatch.session.session import run

        return run(*args, **kwargs)


_run_package.__class__ = _RunPackage


def __getattr__(name: str) -> object:
    if name in ("Session", "RunResult"):
        from qbatch.session import session

        return getattr(session, name)
    raise AttributeError(f"module 'qbatch' has no attribute {name!r}")
