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
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from qbatch.errors import OutputError

TMP_MARK = ".tmp-"
OUTPUT_LOCK = ".qbatch.lock"  # held by the live run of an output folder; there, it marks a qbatch output folder


def normal_path(path: str | os.PathLike[str]) -> str:
    """A path as qbatch keeps and prints it: `out/quickstart`, not `jobs/../out/quickstart` or `./out/`.

    Lexical (`a/..` goes) where that means what the OS means; where a `..` follows a symbolic link to a
    folder, it is the parent of the link's target, so the path up to the last `..` is resolved as the
    OS resolves it. `-` (standard input) and a URL (`s3://bucket/out`: an object store's) stay.
    """
    text = os.fspath(path)
    if text == "-" or is_url(text):
        return text
    parts = text.split(os.sep)
    if ".." in parts:
        last = len(parts) - parts[::-1].index("..")  # just after the last `..`
        if _has_link(parts[:last - 1]):
            text = os.path.join(os.path.realpath(os.sep.join(parts[:last]) or os.sep), *parts[last:])
    return os.path.normpath(text)


def is_url(text: str) -> bool:
    """Whether `text` is a URL (`scheme://...`), not a path: an object store's object or folder (qbatch.storage)."""
    return re.match(r"[a-z][a-z0-9+.-]*://", text) is not None


def _has_link(parts: list[str]) -> bool:
    """Whether a folder of the path `parts` (joined) is a symbolic link."""
    return any(os.path.islink(os.sep.join(parts[:end])) for end in range(1, len(parts) + 1)
               if parts[end - 1] not in ("", ".", ".."))


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Write through `write(tmp_path)`, fsync, rename into place, fsync the folder. Whatever stops it, the
    temporary file goes; an OS error (a full disk, a read-only folder) is an OutputError naming `path`."""
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as exc:
        with suppress(OSError):  # on a read-only folder even removing the temp file fails
            tmp.unlink(missing_ok=True)
        error = exc if isinstance(exc, OSError) else rust_os_error(exc)
        if error is None:
            raise
        raise output_error(f"write {path.name}", path, error) from None


def rust_os_error(exc: BaseException) -> OSError | None:
    """The OS error behind a failure of a Rust library (polars), which says it only in its message:
    "... underlying IO error: No space left on device (os error 28)"; None when it names none."""
    found = re.search(r"\(os error (\d+)\)", str(exc)) if isinstance(exc, Exception) else None
    if found is None:
        return None
    number = int(found.group(1))
    return OSError(number, os.strerror(number))


@contextmanager
def output_os_errors(what: str, path: Path) -> Iterator[None]:
    """Turn an OS error on the output folder into an OutputError: the user can fix those."""
    try:
        yield
    except OSError as exc:
        raise output_error(what, Path(exc.filename or path), exc) from None


def output_error(what: str, path: Path, exc: OSError) -> OutputError:
    """'cannot WHAT: <reason> (path)' with the fix for that reason."""
    if exc.errno == errno.ENOSPC:
        return OutputError(f"cannot {what}: the disk is full", where=str(path),
                           hint="finished parts are intact: free space and rerun the same command to resume")
    if exc.errno == errno.EROFS:
        hint = "the output folder is on a read-only file system: pass another -o/--output-dir"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        hint = "this user may not write there: check the folder's owner and permissions, or pass another -o/--output-dir"
    else:
        hint = "check the output folder, or pass another -o/--output-dir"
    return OutputError(f"cannot {what}: {exc.strerror or exc}", where=str(path), hint=hint)


def atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, default=str) + "\n"))


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: Path, *, hint: str = "rerun with --restart to start this output over") -> Any:
    """A JSON file's value; None when there is none. A file that cannot be read or is not JSON is
    an OutputError naming it (`hint`: how to recover)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise read_error(path, exc, hint) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OutputError(f"{path.name} is corrupt: {exc}", where=str(path), hint=hint) from None


def read_error(path: Path, exc: OSError, hint: str) -> OutputError:
    """'cannot read NAME: <reason> (path)'; the hint is `hint`, or for a permission error how to fix that."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        hint = "this user may not read it: check the file's owner and permissions"
    return OutputError(f"cannot read {path.name}: {exc.strerror or exc}", where=str(path), hint=hint)


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


@contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive fcntl lock on `path` (created if missing); other processes wait for it.

    For "build once": check, lock, check again, build. The OS drops the lock when the holder dies.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def private_folder(path: Path, *, marker: str) -> bool:
    """Make `path` a folder only its owner may enter (0700), creating it and its parents (those as mkdir -p
    makes them); whether it was created. An existing folder open to others is made private when it is empty
    or holds `marker` (a folder of the caller's kind); OpenFolder: another (someone's own folder), left as it
    is. PermissionError: it is another user's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            if not (path / marker).exists() and any(path.iterdir()):
                raise OpenFolder(mode) from None
            os.chmod(path, 0o700)
        return False
    return True


class OpenFolder(Exception):
    """A folder open to other users (`mode`) that holds other files than the caller's."""

    def __init__(self, mode: int):
        super().__init__(f"open to other users (mode {mode:04o})")
        self.mode = mode


class HolderLock:
    """An exclusive fcntl lock on a file that names its holder ("pid N since ...") to whoever finds it taken:
    one live process at a time (an output folder's run, a data folder's service). The OS drops it when the
    holder dies, so a killed holder never blocks the next one."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take it: None, or the holder's words when another process holds it. OSError: the file cannot be
        opened or written (then it is not held)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _first_line(fd)
            os.close(fd)
            return holder or "pid unknown"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}".encode(), 0)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the fcntl lock
            self._fd = None

    def holder(self) -> str | None:
        """Who holds it ("pid N since ..."), or None when no live process does."""
        if not self.path.exists():
            return None
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            return _first_line(fd) or "unknown process"
        finally:
            os.close(fd)


def _first_line(fd: int) -> str:
    """The holder's words: a lock file's first line (what follows is the holder's own, as a run's phase)."""
    return os.pread(fd, 200, 0).decode(errors="replace").partition("\n")[0].strip()
