"""What a process sets up under vLLM's engines, owned by one object with a start and a stop: the Runtime.

- the engine log's routing (engines/vllm_output.ROUTING): vLLM's output to a file, not the terminal;
  the spawn wrapper that sends its processes' output there is put in place around each engine start
  (vllm_output.engine_processes) and taken away after;
- the CUDA MPS daemon the process's engines share (engines/mps.SHARE): started by the first engines
  sharing a GPU, quit by the last, and at the latest by `stop`;
- the reaper (jobs/shutdown.py): a process that kills the engines if this one dies without a word;
- the lock that gives its engines one run at a time, and its Sessions' engine log.

The doors start it: `qbatch run`/`embed`/`bench` and `qbatch serve` for the command, a Session at its runs.
It stays up until the process ends (vLLM's last lines at exit still go to the engine log, and the reaper
outlives the process on purpose: it kills what a dead process left); `stop`, for a process that goes on
(a notebook, a test), puts back what `start` changed. Both may be called again.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

from qbatch.engines import mps, vllm_output
from qbatch.jobs.shutdown import start_reaper

REAPER_STOP_S = 5.0


class Runtime:
    """One process's machinery under its engines (see the module): `start(...)`, then `stop()`, or `with`."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.reaper: subprocess.Popen[bytes] | None = None
        self.started = False
        # One run at a time on the process's engines: an engine serves one run at a time, and threads calling a
        # chat model at once (LangChain's RunnableParallel, thread pools) would otherwise share it (Session).
        self.calls = threading.Lock()
        self.session_log: Path | None = None  # the process's Sessions' engine log, once named (session.py)

    def start(self, *, engine_log: str | os.PathLike[str] | None = None, reaper: bool = False) -> Runtime:
        """Route vLLM's output to `engine_log` (when given), and with `reaper` start the reaper (once)."""
        if engine_log is not None:
            self.route_engine_log(engine_log)
        if reaper and self.reaper is None:
            self.reaper = start_reaper(self.pid)
        self.started = True
        return self

    def route_engine_log(self, path: str | os.PathLike[str] | None) -> None:
        """vLLM's output, in this process and in the engines started from now on, to `path` (vllm_output.py)."""
        vllm_output.ROUTING.route(path)

    @property
    def engine_log(self) -> Path | None:
        """Where vLLM's output goes now (None: the terminal)."""
        return vllm_output.ROUTING.target

    def stop(self) -> None:
        """Once the engines are closed: quit the MPS daemon, stop the reaper, vLLM's output back to the
        terminal (idempotent)."""
        mps.SHARE.stop()
        if self.reaper is not None:
            self.reaper.terminate()
            try:
                self.reaper.wait(REAPER_STOP_S)
            except subprocess.TimeoutExpired:
                self.reaper.kill()
            self.reaper = None
        vllm_output.ROUTING.stop()
        self.started = False

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_RUNTIMES: dict[int, Runtime] = {}  # by pid: a forked child has a Runtime of its own


def this_process() -> Runtime:
    """This process's Runtime (made on first use, started by the doors)."""
    return _RUNTIMES.setdefault(os.getpid(), Runtime())
