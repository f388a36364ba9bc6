"""The local folders that stages (stage.py) work in: each says which process owns it, and those of dead
owners are removed by the next process that makes one.

A stage removes its folder when it closes; a process killed outright (SIGKILL, the OOM killer, a lost
machine) cannot, and its copy of an output folder (parts, inputs: gigabytes) would stay in the temporary
folder for good. So each folder holds OWNER_FILE (host, boot id, pid and the process's start time) beside
the copy (COPY), and making a folder first removes every other one whose owner is dead: on this host, of
an earlier boot, or a pid that is gone or now another process (its start time differs). A folder of
another host (a temporary folder shared between machines) or without an owner record (one being made,
or of an older qbatch) is left alone: nothing says its owner is dead. A host is told by its hostname:
containers that share a temporary folder under one hostname (but not their pids) are not told apart.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from qbatch.log import log

PREFIX = "qbatch-stage-"
OWNER_FILE = "owner.json"
COPY = "folder"  # the stage's copy of the output folder, beside OWNER_FILE (never uploaded with it)


@dataclass(frozen=True)
class Owner:
    """The process a stage folder belongs to; `started` is its start in clock ticks since boot, which
    tells a live owner from a later process given the same pid (None where /proc has none)."""

    host: str
    boot_id: str | None
    pid: int
    started: int | None

    @classmethod
    def me(cls) -> Owner:
        return cls(socket.gethostname(), _boot_id(), os.getpid(), _start_ticks(os.getpid()))

    @classmethod
    def read(cls, folder: Path) -> Owner | None:
        """The folder's owner record; None when it has none or an unreadable one."""
        try:
            found = json.loads((folder / OWNER_FILE).read_text())
            return cls(str(found["host"]), found["boot_id"], int(found["pid"]), found["started"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def dead(self) -> bool:
        """Whether this owner is known to be gone: only a process of this host can be looked at."""
        if self.host != socket.gethostname():
            return False
        if self.boot_id is not None and self.boot_id != _boot_id():
            return True  # the machine rebooted since: every process of that boot is gone
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # alive, another user's
        return self.started is not None and _start_ticks(self.pid) not in (None, self.started)


def new_stage_folder() -> Path:
    """A new stage folder in the temporary folder, this process its recorded owner; its copy goes in COPY.
    Stage folders of dead owners found there are removed first."""
    remove_dead_stages(Path(tempfile.gettempdir()))
    folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    (folder / OWNER_FILE).write_text(json.dumps(asdict(Owner.me())))
    (folder / COPY).mkdir()
    return folder


def remove_dead_stages(tmp: Path) -> list[Path]:
    """Remove the stage folders in `tmp` whose owners are dead; those removed."""
    removed = []
    for folder in sorted(tmp.glob(PREFIX + "*")):
        owner = Owner.read(folder)
        if owner is not None and owner.dead():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
            log.info(f"removed {folder}: the local copy of an output folder of a process that died "
                     f"(pid {owner.pid}) without removing it")
    return removed


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None  # not Linux: the pid and its start time tell


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat's 22nd field); None without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # the fields after the name, which may hold spaces
