"""Durable file-system writes: atomic files and folders, and build-once locks.

A file or folder is written under a temporary name next to its target,
fsynced, then renamed into place (and the rename made durable), so a crash
leaves either the whole thing or nothing. Temporary names carry TMP_MARK so
the next start can remove what a killed process left.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qbatch.errors import OutputError

TMP_MARK = ".tmp-"


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write through `write(tmp_path)`, fsync, rename into place, fsync the folder."""
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise OutputError(
                "disk full while writing output", where=str(path),
                hint="finished parts are intact: free space and rerun the same command to resume",
            ) from None
        raise OutputError(f"cannot write output: {exc.strerror or exc}", where=str(path)) from None


def atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, default=str) + "\n"))


def atomic_folder(target: Path, write: Callable[[Path], None]) -> None:
    """write(temp folder) next to target, fsync its files, rename onto target; on failure nothing is left."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        for path in tmp.iterdir():
            if path.is_file():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; caches may be shared
        os.rename(tmp, target)  # replaces an empty target folder too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(target.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive fcntl lock on `path` (created if missing); other processes wait for it.

    For "build once": check, lock, check again, build. The OS drops the lock when the holder dies.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
