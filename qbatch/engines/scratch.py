"""The folder of a run's temporary engine files, removed when the process that made it ends.

vLLM's processes talk over ZMQ sockets: files named by a uuid in VLLM_RPC_BASE_PATH, the system's temp
folder unless set, which vLLM leaves there (seven a run: a job from cron every few minutes left
thousands). The first process of a run that starts an engine makes a folder and points vLLM's sockets
there (a VLLM_RPC_BASE_PATH the user set is kept); the processes it starts inherit the folder and put
their own temporary files in it too (start_errors.py; a multiprocessing child skips the exit handlers
that would remove them). The engine processes keep the system's temp folder as theirs: torch keeps its
compile cache there (on the CPU, C++ headers that took seconds to build at each start when it moved).
A Ray actor on another machine, where the folder does not exist, makes its own. The folder goes at
its maker's exit, and one left by a process that was killed goes with the next engine start. A
socket's path has a length limit: where the temp folder's own path is too long for the sockets to fit
in a folder below it, they stay where vLLM puts them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

SOCKETS_ENV = "VLLM_RPC_BASE_PATH"
SCRATCH_ENV = "QBATCH_SCRATCH"
PREFIX = "qbatch-"
# The longest socket path (sockaddr_un.sun_path: 107 characters on Linux, 103 on macOS), and the length of
# the name vLLM gives a socket (a uuid4).
SOCKET_PATH_MAX = 103
SOCKET_NAME = 36


def scratch_folder() -> str:
    """This process tree's folder (made here unless an ancestor made it), vLLM's sockets pointed at it;
    called before an engine starts (vLLM reads the setting then)."""
    folder = os.environ.get(SCRATCH_ENV)
    if not folder or not os.path.isdir(folder):
        if folder and os.environ.get(SOCKETS_ENV) == folder:  # an ancestor's pointer, to a folder not here
            del os.environ[SOCKETS_ENV]
        _remove_orphans()
        folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
        atexit.register(shutil.rmtree, folder, True)
        os.environ[SCRATCH_ENV] = folder
    if len(folder) + 1 + SOCKET_NAME <= SOCKET_PATH_MAX:
        os.environ.setdefault(SOCKETS_ENV, folder)
    return folder


def _remove_orphans() -> None:
    """Remove the folders of processes that no longer run (killed before their exit could)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}[0-9]*-*"):
        pid = folder.name.removeprefix(PREFIX).partition("-")[0]
        with contextlib.suppress(OSError):  # gone meanwhile: another run removed it
            if pid.isdigit() and not _running(int(pid)) and folder.stat().st_uid == os.getuid():
                shutil.rmtree(folder, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: running
        return True
    return True
