"""CUDA MPS for the engines sharing a GPU: their kernels run side by side instead of in turns.

Without MPS a GPU runs one process's kernels at a time, so two engines on one GPU take turns (time
slices) and each waits while the other's kernels run, even those that leave most of the GPU idle.
Under MPS one server process holds the GPU for both and runs their kernels together
(faster on prefill- and decode-heavy jobs alike: docs/benchmarks.md, "CUDA MPS").

A run starts a control daemon of its own (`nvidia-cuda-mps-control -f`), its pipe and log folders in
the run's scratch folder (scratch.py), so a daemon the system runs, or another run's, is left alone,
and only this run's engines (given CUDA_MPS_PIPE_DIRECTORY) connect to it; a process's engines of
every configuration share it (acquire), so they do not take turns either. The daemon sees every GPU
(no CUDA_VISIBLE_DEVICES), so an engine's CUDA_VISIBLE_DEVICES names the same GPU with MPS and
without. A shell watches the run's process: it tells the daemon to quit when the run closes the pipe
to it, at its end or at its death, so a run killed outright leaves no daemon behind. Where the daemon
does not start, or a CUDA context cannot be made through it, the engines share the GPU in turns,
with a warning.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from qbatch.engines.scratch import scratch_folder
from qbatch.log import log

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
START_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 60.0
QUIT_TIMEOUT_S = 15.0
# The watcher: the daemon in the background (its stdin /dev/null), `cat` on the run's pipe until it closes,
# then the daemon's own way to stop (the `quit` command), and wait for it.
WATCH = '"$0" -f & cat >/dev/null; echo quit | "$0"; wait'
# A CUDA context on each visible GPU through the driver alone (no torch: seconds to import); prints the
# first CUDA error's code and exits 1 on one.
PROBE = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
count, device, context = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p()
def check(code):
    if code:
        print(code); sys.exit(1)
check(cuda.cuInit(0))
check(cuda.cuDeviceGetCount(ctypes.byref(count)))
for i in range(count.value):
    check(cuda.cuDeviceGet(ctypes.byref(device), i))
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
    check(cuda.cuDevicePrimaryCtxRelease_v2(device))
"""


@dataclass(frozen=True)
class Daemon:
    """A running MPS control daemon of this run: the environment its engines get, and how it stops."""

    folder: Path
    watcher: subprocess.Popen[bytes]

    def env(self) -> dict[str, str]:
        """What an engine's process adds to its environment to run under this daemon."""
        return _folders_env(self.folder)

    def stop(self) -> None:
        """Quit the daemon (once the engines are gone: its clients fail from then on) and wait for it."""
        if self.watcher.stdin and not self.watcher.stdin.closed:
            self.watcher.stdin.close()  # the watcher's `cat` ends: it sends `quit`
        try:
            self.watcher.wait(timeout=QUIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the CUDA MPS daemon did not quit in %.0fs; killed", QUIT_TIMEOUT_S)
            os.killpg(self.watcher.pid, signal.SIGKILL)
            self.watcher.wait()


class DaemonShare:
    """The daemon a process's engines share: started by the first engines that need it, quit when the last
    are gone (a count of its users). One a process (SHARE), owned by the process's Runtime
    (qbatch/jobs/runtime.py), whose stop quits a daemon still running."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._daemon: Daemon | None = None  # while engines use it (acquire)
        self._users = 0

    def acquire(self, devices: tuple[str, ...], log_path: Path | None = None) -> Daemon | None:
        """This process's daemon for engines on `devices`, started by the first engines that need it: all of a
        process's engines (a Session's generation and embedding engines) share one server, so none of them
        takes turns with another. None, with a warning, where it cannot serve these devices."""
        with self._lock:
            if self._daemon is None or self._daemon.watcher.poll() is not None:
                self._daemon, self._users = start(devices, log_path), 0
            elif problem := _probe(self._daemon, devices):  # the running one serves the engines on other GPUs
                _turns(problem)
                return None
            if self._daemon is not None:
                self._users += 1
            return self._daemon

    def release(self, daemon: Daemon) -> None:
        """The engines that acquired `daemon` are gone: it quits once none are left."""
        with self._lock:
            if daemon is not self._daemon:  # restarted meanwhile (this one had died)
                daemon.stop()
                return
            self._users -= 1
            if self._users == 0:
                self._daemon = None
                daemon.stop()

    def stop(self) -> None:
        """Quit the daemon now, whoever still uses it (idempotent): the process is done with its engines."""
        with self._lock:
            daemon, self._daemon, self._users = self._daemon, None, 0
        if daemon is not None:
            daemon.stop()


SHARE = DaemonShare()


def acquire(devices: tuple[str, ...], log_path: Path | None = None) -> Daemon | None:
    """SHARE.acquire: the process's daemon for engines on `devices` (None: they take turns)."""
    return SHARE.acquire(devices, log_path)


def release(daemon: Daemon) -> None:
    """SHARE.release: the engines that acquired `daemon` are gone."""
    SHARE.release(daemon)


def start(devices: tuple[str, ...], log_path: Path | None = None) -> Daemon | None:
    """A daemon for engines on `devices` (CUDA_VISIBLE_DEVICES entries), its output appended to `log_path`,
    checked with a CUDA context on each device through it; None, with a warning, where it cannot run (the
    engines then take turns)."""
    program = shutil.which(CONTROL)
    if program is None:
        _turns(f"{CONTROL} not found")
        return None
    folder = Path(tempfile.mkdtemp(prefix="mps-", dir=scratch_folder()))  # a socket's path is short
    (folder / "pipe").mkdir()
    (folder / "log").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    try:
        with open(log_path or os.devnull, "ab") as output:
            watcher = subprocess.Popen(["/bin/sh", "-c", WATCH, program], stdin=subprocess.PIPE, stdout=output,
                                       stderr=subprocess.STDOUT, start_new_session=True,
                                       env={**env, **_folders_env(folder)})
    except OSError as exc:
        _turns(str(exc))
        return None
    daemon = Daemon(folder, watcher)
    problem = _wait_listening(daemon) or _probe(daemon, devices)
    if problem:
        daemon.stop()
        _turns(problem)
        return None
    log.debug("CUDA MPS daemon running for the engines (%s)", folder)
    return daemon


def _folders_env(folder: Path) -> dict[str, str]:
    """The daemon's pipe and log folders, as the daemon and its clients read them from the environment."""
    return {PIPE_ENV: str(folder / "pipe"), LOG_ENV: str(folder / "log")}


def _turns(problem: str) -> None:
    """No MPS for these engines: they take turns on their GPU, as without it; the user is told why."""
    log.warning("CUDA MPS did not start (%s): engines sharing a GPU take turns on it; --no-mps skips the try",
                problem)


def _wait_listening(daemon: Daemon) -> str | None:
    """None once the daemon listens (its control socket exists), else what went wrong."""
    control = daemon.folder / "pipe" / "control"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not control.exists():
        if daemon.watcher.poll() is not None:
            return f"{CONTROL} exited"
        if time.monotonic() > deadline:
            return f"{CONTROL} did not listen"
        time.sleep(0.02)
    return None


def _probe(daemon: Daemon, devices: tuple[str, ...]) -> str | None:
    """None when a CUDA context can be made through the daemon on each device, else what went wrong."""
    env = {**os.environ, **daemon.env(), "CUDA_VISIBLE_DEVICES": ",".join(dict.fromkeys(devices))}
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"no CUDA context through it in {PROBE_TIMEOUT_S:.0f}s"
    if done.returncode:
        code = done.stdout.strip()
        said = f"CUDA error {code}" if code else (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"a CUDA context through it failed: {said}"
    return None
