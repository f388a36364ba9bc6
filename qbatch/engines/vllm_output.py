"""vLLM's own output: into the engine log (a file), not the terminal; shown with -v or QBATCH_VERBOSE=1.

vLLM writes from several places: its `vllm` logger, in this process and in each process of its
engine (the engine core, its workers), and those processes' stdout and stderr (C++ and torch
warnings, Python warnings, tqdm bars). The engine log is chosen with `use()`: the CLI's
OUT_DIR/engine.log, the service's DATA_DIR/engine.log, a Session's log under qbatch's cache.
- In this process, vLLM's log stream (VLLM_LOGGING_STREAM, looked up when vLLM configures its
  logging) is `vllm_stream` below, which writes to the engine log.
- The processes an engine's start spawns (`engine_processes()`) begin with stdout and stderr on
  the engine log (engine_process.sh); forked ones move there at the fork. Their own lookup of
  `vllm_stream` gives them their stderr.
This process's own stderr is never redirected: qbatch's lines and its bar are written there by
other threads at the same time. When an engine fails, the last lines of its log are shown with
the error. Verbose, or with a logging setup of the user's own (VLLM_LOGGING_CONFIG_PATH,
VLLM_CONFIGURE_LOGGING=0, VLLM_LOGGING_STREAM), vLLM writes to the terminal as it does alone.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.spawn
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from qbatch.log import log

VERBOSE_ENV = "QBATCH_VERBOSE"
STREAM_ENV = "VLLM_LOGGING_STREAM"
STREAM = "ext://qbatch.engines.vllm_output.vllm_stream"
USER_LOGGING_ENVS = ("VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING")
LOG_ENV = "QBATCH_ENGINE_LOG"  # the engine log of the processes an engine start creates (unset: the terminal)
OWNER_ENV = "QBATCH_ENGINE_OWNER"  # the pid starting an engine: any other process that has it is the engine's
PYTHON_ENV = "QBATCH_ENGINE_PYTHON"  # the Python the wrapper runs
WRAPPER = Path(__file__).with_name("engine_process.sh")
EARLY_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
TAIL_LINES = 20
TAIL_BYTES = 64 << 10
KEPT_SESSION_LOGS = 20


def verbosity() -> int:
    """0: vLLM's output to the engine log; 1 (-v, QBATCH_VERBOSE=1): to the terminal; 2: vLLM at DEBUG too."""
    value = os.environ.get(VERBOSE_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return 0
    return int(value) if value.isdigit() else 1


def set_verbosity(level: int) -> None:
    """The CLI's -v count; an environment variable, so the processes this one starts see it too."""
    if level:
        os.environ[VERBOSE_ENV] = str(level)
    if level >= 2:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG")  # read by vLLM at its import


class LogRouting:
    """Where vLLM's output goes in this process: what `route` changed (vLLM's stream setting, a handler for
    its early records, the engine log), and `stop` puts back. One a process (ROUTING): vLLM looks its
    stream up by name (STREAM), in this module. Owned by the process's Runtime (qbatch/jobs/runtime.py)."""

    def __init__(self) -> None:
        self.target: Path | None = None
        self._set_stream = False  # this routing named vLLM's stream in the environment
        self._early: logging.Handler | None = None  # its handler for vLLM's records before vLLM's logging setup

    def route(self, path: str | os.PathLike[str] | None) -> None:
        """vLLM's output in this process goes to `path` from now on, and that of the engines started from
        now on; None, verbose, or a logging setup of the user's own: to the terminal."""
        self.target = None if path is None or verbosity() or _user_owns_vllm_logging() else Path(path)
        if STREAM_ENV not in os.environ:
            os.environ[STREAM_ENV], self._set_stream = STREAM, True
        _retarget_loaded_vllm()
        if self.target is not None and self._early is None:
            self._early = _catch_early_records()

    def stop(self) -> None:
        """vLLM's output to the terminal again, its stream setting and early handler as before `route` (idempotent)."""
        self.target = None
        if self._set_stream and os.environ.get(STREAM_ENV) == STREAM:
            del os.environ[STREAM_ENV]
        self._set_stream = False
        if self._early is not None:
            logging.getLogger("vllm").removeHandler(self._early)
            self._early = None


def use(path: str | os.PathLike[str] | None) -> None:
    """ROUTING.route(path): the process's engine log (its Runtime routes it: qbatch/jobs/runtime.py)."""
    ROUTING.route(path)


def current() -> Path | None:
    """The engine log vLLM's output goes to in this process now (None: the terminal)."""
    return ROUTING.target


@dataclass(frozen=True)
class EngineLog:
    """One engine's log: the file, and where in it the engine's start begins (a log is appended to)."""

    path: Path | None
    start: int = 0

    def tail(self, lines: int = TAIL_LINES) -> list[str]:
        """The last `lines` lines the engine wrote (after its start), the latest state of a tqdm bar each."""
        if self.path is None:
            return []
        try:
            with open(self.path, "rb") as handle:
                size = handle.seek(0, os.SEEK_END)
                handle.seek(max(self.start, size - TAIL_BYTES))
                text = handle.read().decode("utf-8", "replace")
        except OSError:
            return []
        kept = [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]
        return [line[:500] for line in kept if line][-lines:]

    def show_tail(self) -> None:
        """Log the engine's last lines as an error (an engine that failed): its own error is there."""
        lines = self.tail()
        if lines:
            log.error("vLLM's last %d lines (%s):\n%s", len(lines), self.path, "\n".join(f"  {line}" for line in lines))


@contextmanager
def engine_processes() -> Iterator[EngineLog]:
    """The processes started in this block are an engine's (vLLM's engine core and workers, qbatch's
    data-parallel workers, and the processes they start): their output goes to the engine log."""
    path = current()
    python = multiprocessing.spawn.get_executable()
    wrap = path is not None and os.fsdecode(python) != str(WRAPPER) and os.access(WRAPPER, os.X_OK)
    values = {OWNER_ENV: str(os.getpid()), LOG_ENV: None if path is None else str(path),
              PYTHON_ENV: os.fsdecode(python) if wrap else None}
    saved = {name: os.environ.get(name) for name in values}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    _set_environ(values)
    if wrap:
        multiprocessing.spawn.set_executable(str(WRAPPER))
    try:
        yield EngineLog(path, _size(path))
    finally:
        if wrap:
            multiprocessing.spawn.set_executable(python)
        _set_environ(saved)


def enter_engine_process() -> None:
    """In a process started inside `engine_processes()` (at its first lookup of `vllm_stream`, at
    its fork, or a data-parallel worker at its start): its stdout and stderr go to the engine log
    (where the wrapper has not put them), and it ends as a forked child does (_ExitAsForked)."""
    global _entered
    if _entered:
        return
    _entered = True
    path = os.environ.get(LOG_ENV)
    ROUTING.target = Path(path) if path else None
    if path:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    _ExitAsForked.install()


def fresh_session_log(folder: Path) -> Path:
    """A new log file in `folder` for this process's Python sessions; the oldest beyond KEPT_SESSION_LOGS go."""
    import time

    old = sorted(folder.glob("session-*.log"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    for stale in old[:max(0, len(old) - KEPT_SESSION_LOGS + 1)]:
        stale.unlink(missing_ok=True)
    return folder / f"session-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


class _ExitAsForked(logging.Handler):
    """multiprocessing ends a child process it forked with os._exit(exitcode) right after logging that
    code ("process exiting with exitcode N"), and a spawned one through the interpreter's teardown.
    An engine process ends as a forked one: by then vLLM's own shutdown has torn the engine down, and
    the teardown's garbage collection of millions of objects took seconds, past the grace vLLM gives
    its processes, which were then killed before releasing their shared memory."""

    EXITING = re.compile(r"process exiting with exitcode (-?\d+)")

    @classmethod
    def install(cls) -> None:
        from multiprocessing import util

        logger = util.get_logger()
        if not any(isinstance(handler, cls) for handler in logger.handlers):
            logger.addHandler(cls(util.INFO))
        if logger.level == logging.NOTSET or logger.level > util.INFO:
            logger.setLevel(util.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        exiting = self.EXITING.fullmatch(record.getMessage())
        if exiting is None or multiprocessing.parent_process() is None:
            return
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os._exit(int(exiting[1]))


class _MainStream:
    """vLLM's log stream in the process that runs qbatch: the current engine log, else stderr."""

    def __init__(self) -> None:
        self._path: Path | None = None
        self._file: TextIO | None = None

    def write(self, text: str) -> int:
        path = current()
        if path is not None:
            try:
                handle = self._open(path)
                handle.write(text)
                handle.flush()  # nothing buffered: a forked engine process inherits this object
                return len(text)
            except OSError:
                pass
        return sys.stderr.write(text)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def _open(self, path: Path) -> TextIO:
        if self._file is None or self._path != path:
            if self._file is not None:
                self._file.close()
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file, self._path = open(path, "a", encoding="utf-8"), path
        return self._file


ROUTING = LogRouting()
_entered = False
_MAIN_STREAM = _MainStream()


def __getattr__(name: str) -> Any:
    """`vllm_stream`, looked up by vLLM's logging setup (STREAM) in each of its processes."""
    if name != "vllm_stream":
        raise AttributeError(name)
    if _is_engine_process():
        enter_engine_process()
        return sys.stderr
    return _MAIN_STREAM


def _is_engine_process() -> bool:
    owner = os.environ.get(OWNER_ENV)
    return _entered or (owner is not None and owner != str(os.getpid()))


def _after_fork_in_child() -> None:
    if _is_engine_process():  # a forked engine process looks up no stream: vLLM's logging came along configured
        enter_engine_process()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _user_owns_vllm_logging() -> bool:
    config_path, configure = (os.environ.get(name) for name in USER_LOGGING_ENVS)
    return bool(config_path) or configure == "0" or os.environ.get(STREAM_ENV, STREAM) != STREAM


def _catch_early_records() -> logging.Handler | None:
    """What vLLM logs before it configures its logging (its import warns of a Triton without a CPU
    backend) goes to the engine log too; vLLM's configuration replaces this handler (returned; None
    where vLLM's logger had handlers already)."""
    logger = logging.getLogger("vllm")
    if logger.handlers:
        return None
    handler = logging.StreamHandler(_MAIN_STREAM)
    handler.setFormatter(logging.Formatter(EARLY_FORMAT))
    logger.addHandler(handler)
    return handler


def _retarget_loaded_vllm() -> None:
    """vLLM imported before qbatch named its stream (a notebook that imported it first) writes where
    it chose then (stdout): its handler gets the stream it would have looked up."""
    if "vllm.logger" not in sys.modules or os.environ.get(STREAM_ENV) != STREAM:
        return
    terminals = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s is not None}
    for handler in logging.getLogger("vllm").handlers:
        if isinstance(handler, logging.StreamHandler) and id(handler.stream) in terminals:
            handler.setStream(_MAIN_STREAM)


def _set_environ(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0
