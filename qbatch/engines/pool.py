"""The engines of one owner (a CLI command, a Session, `qbatch serve`, the bench): started on first use,
kept for the owner's next runs, closed when the owner is done.

Engine start costs tens of seconds, so whoever runs jobs opens a pool and hands it to each run
(`runner.run(spec, pool)`): a run gets the engine of its configuration (an EngineConfig, resolved by
qbatch/plan/), started by the first run that needs it and reused by the next. The configuration alone
is the key: job settings that never reach LLM(...) (a seed, sampling) share the engine. The owner
closes the pool when it is done (close_all(), the end
of a `with` block); a pool its owner dropped, or left open at exit, closes its engines then: left
to vLLM's own finalizers, an engine process could outlive the program. The implementations
(vllm.py, processes.py, ray_actors.py) sit below this module and never import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from qbatch.engines.base import Engine, NullEngine, vector_size
from qbatch.engines.config import EngineConfig
from qbatch.engines.processes import DataParallelEngine
from qbatch.engines.ray_actors import RayEngine
from qbatch.engines.scratch import scratch_folder
from qbatch.engines.vllm import VllmEngine
from qbatch.log import log

# Shares of a GPU's memory add up to at most the whole, give or take float rounding (2 x 0.45 + 0.1).
SHARE_SLACK = 1e-6

# How a pool starts an engine: (config, wait=...) -> engine. `wait=False` (start_early) may return
# before the engine is loaded: get() then calls its wait_ready().
StartEngine = Callable[..., Engine]


def start_engine(config: EngineConfig, *, wait: bool = True) -> Engine:
    """A new engine of this configuration: the null engine, engines in Ray actors, several engines on this
    host (processes of their own; `wait=False` returns while they load), or one vLLM engine."""
    if config.backend == "null":
        return NullEngine(vector_size(config.model_path, config.backend) if config.task == "embed" else None)
    scratch_folder()  # before any engine process starts: they inherit it (scratch.py)
    if config.backend == "ray":
        return RayEngine(config)
    if config.engine_count() > 1:
        return DataParallelEngine(config, wait=wait)
    return VllmEngine(config)


class EnginePool:
    """The engines one owner started, one per configuration, handed to each of its runs.

    `max_engines`: keep at most this many; starting one more closes the least recently used first
    (each engine holds its model and KV cache). `start`: how an engine starts (start_engine; a test
    passes a stand-in). An engine with nothing to close (the null engine) costs nothing to start and
    is not kept: each run gets a new one. `kept`: its engines serve later runs (a Session's, a service's),
    which may start them compiled (plan/placement.choose_kept_engines); a command's own pool is not.

    On a GPU an engine holds its share of the GPU's memory (its gpu_memory_utilization), and vLLM refuses to
    start one with less free: a run whose settings need another configuration (a JSON schema adds the
    reasoning parser; a large job may start compiled) would fail where an earlier one's engines fill the GPU.
    So starting one closes the least recently used engines whose memory it needs (`gpu_room`), as for
    max_engines. The service passes False: its online driver and its runs use engines at once, so its
    configurations must fit side by side (--gpu-memory-utilization), and vLLM's error says so when they do not.
    """

    def __init__(self, *, max_engines: int | None = None, start: StartEngine = start_engine, kept: bool = False,
                 gpu_room: bool = True):
        if max_engines is not None and max_engines < 1:
            raise ValueError(f"max_engines must be >= 1, got {max_engines}")
        self.max_engines = max_engines
        self.kept = kept
        self.gpu_room = gpu_room
        self._start = start
        self._engines: OrderedDict[EngineConfig, Engine] = OrderedDict()  # least recently used first
        # Closes the engines when the pool is dropped or at exit; created before the first engine starts,
        # so at exit it runs after that engine's own exit hooks (its watchdog stops first).
        self._finalizer = weakref.finalize(self, _close_engines, self._engines)

    def get(self, config: EngineConfig) -> Engine:
        """The engine of this configuration, started now unless the pool has it; once it is ready."""
        engine = self._engines.get(config)
        if engine is None:
            engine = self._new(config, wait=True)
        else:
            self._engines.move_to_end(config)
        try:
            getattr(engine, "wait_ready", lambda: None)()  # one started early may still be loading
        except BaseException:
            self._engines.pop(config, None)  # it failed to start (and closed itself): the next run starts anew
            raise
        return engine

    def start_early(self, config: EngineConfig) -> float | None:
        """Start engines that load in processes of their own (several on this host) without waiting for
        them, so that they load while the run reads its inputs; get() waits. When they started
        (time.monotonic()); None where get() starts the engine itself (one engine in this process,
        Ray, the null engine) or the pool has it."""
        if config.backend != "vllm" or config.engine_count() < 2 or config in self._engines:
            return None
        started = time.monotonic()
        self._new(config, wait=False)
        return started

    def would_fork(self, config: EngineConfig) -> bool:
        """Whether get() would fork this process: it starts a single vLLM engine (its engine core).

        A fork while other threads run can leave the child with locks that never open, so a run
        starts its threads after such a get().
        """
        if config.backend == "null" or config.engine_count() > 1:  # data parallel workers are spawned
            return False
        return not self.has(config)

    def has(self, config: EngineConfig) -> bool:
        """Whether the pool holds an engine of this configuration (started, or starting)."""
        return config in self._engines

    def engines(self) -> list[Engine]:
        """The engines the pool holds, least recently used first."""
        return list(self._engines.values())

    def drop_dead(self) -> None:
        """Forget engines whose engine process died, so the next run starts a new one, and abort the
        requests a stopped run left in the others (the next run would step through them first).

        Ctrl-C in a terminal and Jupyter's interrupt reach vLLM's engine process too (it shares the
        process group) and it shuts down, seconds after the run has stopped.
        """
        for key, engine in list(self._engines.items()):
            is_alive = getattr(engine, "is_alive", None)  # engines in this process (VllmEngine)
            if is_alive is None:
                continue
            if not is_alive():
                self._engines.pop(key, None)
                with contextlib.suppress(Exception):
                    engine.close()  # type: ignore[attr-defined]
            else:
                engine.abort_unfinished()  # type: ignore[attr-defined]

    def close_all(self) -> None:
        """Shut down every engine of the pool (it stays usable: a later get() starts anew)."""
        _close_engines(self._engines)

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_all()

    def __repr__(self) -> str:
        limit = f", max_engines={self.max_engines}" if self.max_engines else ""
        return f"EnginePool({len(self._engines)} engines{limit})"

    def _new(self, config: EngineConfig, *, wait: bool) -> Engine:
        if config.backend != "null":
            self._make_room(config)
        with main_hidden_from_children():
            engine = self._start(config, wait=wait)
        if hasattr(engine, "close"):
            self._engines[config] = engine
        return engine

    def _make_room(self, config: EngineConfig) -> None:
        """Close the least recently used engines until one more fits max_engines, and those whose share of
        `config`'s GPUs it needs."""
        while self.max_engines is not None and len(self._engines) >= self.max_engines:
            _, engine = self._engines.popitem(last=False)
            engine.close()  # type: ignore[attr-defined]
        for key in self.crowded_out(config) if self.gpu_room else []:
            log.info(f"closing the engines of an earlier configuration (they differ in {_differences(key, config)}): "
                     f"the new one needs their share of GPU {', '.join(sorted(key.gpu_shares()))}'s memory")
            self._engines.pop(key).close()  # type: ignore[attr-defined]

    def crowded_out(self, config: EngineConfig) -> list[EngineConfig]:
        """The engines `config`'s would not fit beside on its GPUs (their memory shares add up past the whole),
        least recently used first: as many as it takes."""
        needed = config.gpu_shares()
        held: dict[str, float] = {}
        for key in self._engines:
            for device, share in key.gpu_shares().items():
                held[device] = held.get(device, 0.0) + share
        out: list[EngineConfig] = []
        for key in self._engines:  # least recently used first
            short = {device for device, share in needed.items() if held.get(device, 0.0) + share > 1 + SHARE_SLACK}
            shares = key.gpu_shares()
            if not short:
                break
            if short & shares.keys():
                out.append(key)
                for device, share in shares.items():
                    held[device] -= share
        return out


def _differences(old: EngineConfig, new: EngineConfig) -> str:
    """The settings two configurations differ in, by name (the log line of a pool closing engines)."""
    before, after = dict(old.llm_args), dict(new.llm_args)
    names = [name for name in sorted(before.keys() | after.keys()) if before.get(name) != after.get(name)]
    names += [f.name for f in dataclasses.fields(EngineConfig) if f.compare and f.name != "llm_args"
              and getattr(old, f.name) != getattr(new, f.name)]
    return ", ".join(dict.fromkeys(names)) or "nothing"


def _close_engines(engines: OrderedDict[EngineConfig, Any]) -> None:
    """Close every engine of `engines` and forget it (a pool's, also from its finalizer: never the pool itself)."""
    while engines:
        _, engine = engines.popitem()
        engine.close()


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
    saved: dict[str, Any] = {name: vars(main)[name] for name in ("__file__", "__spec__") if name in vars(main)}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None  # multiprocessing reads it (a module run with -m is imported again by its name)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)
