"""Which engine a spec gets, and the per-process cache that keeps engines loaded between runs.

The factory sits above the implementations (vllm.py, processes.py, ray_actors.py): they
import their base (base.py), never this module. Engine start costs tens of seconds, so an
engine is kept per process and settings, and reused by the next run with the same ones
(the CLI closes them when a command ends, a Python Session when it is closed).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator
from typing import Any

from qbatch.engines.base import Engine, NullEngine, vector_size
from qbatch.engines.processes import DataParallelEngine
from qbatch.engines.ray_actors import RayEngine
from qbatch.engines.vllm import VllmEngine
from qbatch.spec import EngineSpec

Key = tuple[str, int, str]

_ENGINES: dict[Key, Engine] = {}
_CLOSING_AT_EXIT: list[bool] = []


def create(spec: EngineSpec, model_path: str, max_model_len: int) -> Engine:
    """The engine for a spec; one per process and settings, reused (engine start costs tens of seconds)."""
    if spec.backend == "null":
        return NullEngine(vector_size(model_path, spec.backend) if spec.task == "embed" else None)
    if spec.backend == "ray":
        engine_class: Any = RayEngine
    elif spec.engine_count() > 1:
        engine_class = DataParallelEngine
    else:
        engine_class = VllmEngine
    key = _key(spec, model_path, max_model_len)
    if key not in _ENGINES:
        _close_at_exit()
        with main_hidden_from_children():
            _ENGINES[key] = engine_class(spec, model_path, max_model_len)
    engine = _ENGINES[key]
    getattr(engine, "wait_ready", lambda: None)()  # one started by prestart() may still be loading
    return engine


def prestart(spec: EngineSpec, model_path: str, max_model_len: int) -> float | None:
    """Start an engine whose workers are processes of their own (several engines on this host)
    without waiting: create() later waits for it. When it started (time.monotonic()); None where
    create() starts the engine itself (one engine in this process, Ray, the null engine, or cached)."""
    key = _key(spec, model_path, max_model_len)
    if spec.backend != "vllm" or spec.engine_count() < 2 or key in _ENGINES:
        return None
    started = time.monotonic()
    _close_at_exit()
    with main_hidden_from_children():
        _ENGINES[key] = DataParallelEngine(spec, model_path, max_model_len, wait=False)
    return started


@contextlib.contextmanager
def main_hidden_from_children() -> Iterator[None]:
    """Start processes without telling them of the main module.

    An engine's processes are started with multiprocessing's spawn (vLLM's engine core on the CPU or
    once CUDA is up, data-parallel workers always), which runs the main module again in every child:
    a script read from standard input cannot be (its `__file__` is "<stdin>", no file), and a script
    that starts a Session outside `if __name__ == "__main__":` would start it again in the child.
    Nothing these processes run comes from the main module, so they are told of none, as under
    `python -c` or in a notebook, while they start.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: vars(main)[name] for name in ("__file__", "__spec__") if name in vars(main)}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None  # multiprocessing reads it (a module run with -m is imported again by its name)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def forks_on_create(spec: EngineSpec, model_path: str, max_model_len: int) -> bool:
    """Whether create() would fork this process: a new single vLLM engine (its engine core).

    A fork while other threads run can leave the child with locks that never open, so
    callers start their threads after such a create.
    """
    if spec.backend == "null" or spec.engine_count() > 1:  # data parallel workers are spawned
        return False
    return _key(spec, model_path, max_model_len) not in _ENGINES


def is_cached(spec: EngineSpec, model_path: str, max_model_len: int) -> bool:
    """Whether an engine for these settings is cached (started, or starting) in this process."""
    return _key(spec, model_path, max_model_len) in _ENGINES


def cached_keys() -> set[Key]:
    """The keys of the engines cached now (a caller notes which ones a run started)."""
    return set(_ENGINES)


def cached() -> list[Engine]:
    """The engines cached now."""
    return list(_ENGINES.values())


def close(key: Key) -> None:
    """Shut down one cached engine and forget it (nothing if it is gone already)."""
    engine = _ENGINES.pop(key, None)
    closer = getattr(engine, "close", None)
    if closer is not None:
        closer()


def drop_dead() -> None:
    """Forget cached engines whose engine process died, so the next run starts a new one, and abort
    the requests an interrupted run left in the others (the next run would step through them first).

    Ctrl-C in a terminal and Jupyter's interrupt reach vLLM's engine process too (it shares the
    process group) and it shuts down, seconds after the run has stopped.
    """
    for key, engine in list(_ENGINES.items()):
        is_alive = getattr(engine, "is_alive", None)  # engines in this process (VllmEngine)
        if is_alive is None:
            continue
        if not is_alive():
            _ENGINES.pop(key, None)
            with contextlib.suppress(Exception):
                engine.close()
        else:
            engine.abort_unfinished()


def close_all() -> None:
    """Shut down every cached engine (the CLI calls this when a command ends)."""
    while _ENGINES:
        _, engine = _ENGINES.popitem()
        closer = getattr(engine, "close", None)
        if closer is not None:
            closer()


def _key(spec: EngineSpec, model_path: str, max_model_len: int) -> Key:
    return (model_path, max_model_len, repr(sorted(dataclasses.asdict(spec).items())))


def _close_at_exit() -> None:
    """Engines cached by a program that calls qbatch (qbatch.run) are shut down when it exits: left to
    vLLM's own finalizers, an engine process could outlive it. Registered before the first engine starts,
    so it runs after that engine's watchdog stops (atexit runs last-registered first)."""
    if not _CLOSING_AT_EXIT:
        _CLOSING_AT_EXIT.append(True)
        atexit.register(close_all)
