"""An output folder in an object store, worked on through a local copy ("stage").

A run takes the folder's lock (lock.py), copies its objects into a new local folder, and runs there as on
any local folder (OutputDir: atomic parts, manifest, resume by ids). Every lease / 4 seconds a thread renews
the lease and uploads what changed: new parts first, each as one whole object, then manifest.json, so an
object store's reader never finds a manifest that counts parts it cannot see; files the run removed
(--restart) are removed there first. A folder's first manifest.json goes up before its parts instead, as a
local run writes it before its first part (parts without a manifest are refused on resume). A run killed
outright loses what it wrote since the last sync, which its resume (from any machine, once the lease
lapsed) redoes; its local copy is removed by the next process that stages (scratch.py). Closing uploads
the rest (manifest.json last), releases the lock and removes the local copy. A run that lost its lock (it
stopped renewing for longer than the lease, and another run took the folder) uploads nothing more and fails.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from qbatch._fs import OUTPUT_LOCK, TMP_MARK
from qbatch.errors import LockedError, QbatchError
from qbatch.log import carried, log
from qbatch.storage.lock import RemoteLock
from qbatch.storage.scratch import COPY, new_stage_folder
from qbatch.storage.store import ObjectInfo, Store
from qbatch.storage.thin import Thin, copy_thin, is_thin
from qbatch.storage.urls import Url

REMOTE_INPUTS = "inputs/remote"  # copies of remote inputs (inputs/remote.py): not uploaded, the objects are there
LAST = "manifest.json"  # uploaded after the parts it counts


class StagedFolder:
    """A local copy of the object-store folder `url` (`path`), kept in step with it while open."""

    def __init__(self, url: Url, *, locked: bool, thin: Thin | None = None):
        self.url, self.locked, self.thin = url, locked, thin
        self.store = Store(url)
        self.lock = RemoteLock(self.store, url) if locked else None
        self.root = new_stage_folder()  # removed by close() or discard(), or once this process died (scratch.py)
        self.path = self.root / COPY
        self._synced: dict[str, tuple[int, int]] = {}  # relative name: (size, mtime_ns) as last uploaded or pulled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: str | None = None  # why this run may no longer write (lost its lock)
        self._sync_lock = threading.Lock()
        self._thin: dict[str, ObjectInfo] = {}  # thin copies (thin.py) not yet made whole, by name

    def open(self) -> StagedFolder:
        try:
            if self.lock is not None:
                self.lock.acquire()
            self.pull()
        except BaseException:
            self.discard()
            raise
        if self.lock is not None:
            self._thread = threading.Thread(target=carried(self._keep_in_step), name="qbatch-stage", daemon=True)
            self._thread.start()
        return self

    def pull(self) -> None:
        """Copy the folder's objects (not its lock) into the stage: thin, those `thin` names (thin.py)."""
        for found in self.store.walk(self.url):
            name = self.url.relative(found.url)
            if name == OUTPUT_LOCK or TMP_MARK in name:
                continue
            local = self.path / name
            rule = self.thin
            if rule is not None and rule.names(name) and copy_thin(self.store, found, local, rule.columns):
                self._thin[name] = found
            else:
                self.store.download(found.url, local)
            self._synced[name] = _stamp(local)
        log.debug(f"{self.url}: {len(self._synced)} objects copied to {self.path} ({len(self._thin)} thin), "
                  f"{self.store.bytes_read:,} bytes")

    def fill(self, folder: Path) -> None:
        """Make the thin copies below the local `folder` whole (a reader of every column comes next)."""
        below = folder.relative_to(self.path).as_posix()
        for name in sorted(self._thin):
            if below == "." or name.startswith(below + "/"):
                with self._sync_lock:
                    if is_thin(self.path / name):  # not replaced by the run meanwhile
                        self.store.download(self._thin[name].url, self.path / name)
                        self._synced[name] = _stamp(self.path / name)
                    del self._thin[name]

    def urls_of(self, files: list[Path]) -> dict[str, str]:
        """The URL in the store of each of `files` that lies in the local copy, by its path."""
        local = self.path.resolve()
        return {str(file): str(self.url.child(file.resolve().relative_to(local).as_posix()))
                for file in files if file.resolve().is_relative_to(local)}

    def objects(self) -> list[ObjectInfo]:
        return self.store.walk(self.url)

    # -- keeping in step ------------------------------------------------------
    def _keep_in_step(self) -> None:
        assert self.lock is not None
        while not self._stop.wait(self.lock.lease / 4):
            try:
                if not self.lock.renew():
                    self._lost = "its lease lapsed and another run took the folder over"
                    log.error(f"{self.url}: this run lost its lock ({self._lost}); it uploads nothing more")
                    return
                self.push()
            except QbatchError as exc:  # the store unreachable for a while: the next round tries again
                log.warning(f"{self.url}: cannot sync the output folder yet: {exc}")

    def push(self) -> None:
        """Upload what changed since the last push (parts first, manifest.json last); remove what went."""
        with self._sync_lock:
            if self._lost:
                return
            now = {name: _stamp(self.path / name) for name in self._local_names()}
            for name in sorted(set(self._synced) - set(now)):
                self.store.delete(self.url.child(name))
                del self._synced[name]
            changed = [name for name, stamp in now.items() if self._synced.get(name) != stamp]
            # A folder's first manifest goes first (parts without one are refused on resume: a run writes its
            # manifest before its first part), a later one last (a completed one counts the parts before it).
            first = LAST not in self._synced
            for name in sorted(changed, key=lambda n: ((n == LAST) != first, n)):
                if name in self._thin and is_thin(self.path / name):
                    # rewritten without its rows (a reader of every column that did not fill() first): the
                    # object keeps them
                    log.error(f"{self.url.child(name)}: not uploaded: its local copy holds only some columns")
                    continue
                self.store.upload(self.path / name, self.url.child(name))
                self._synced[name] = now[name]
                self._thin.pop(name, None)

    def _local_names(self) -> list[str]:
        names = []
        for file in self.path.rglob("*"):
            name = file.relative_to(self.path).as_posix()
            if file.is_file() and not file.is_symlink() and TMP_MARK not in file.name and name != OUTPUT_LOCK \
                    and not name.startswith(REMOTE_INPUTS + "/"):
                names.append(name)
        return names

    @contextmanager
    def naming_errors(self) -> Iterator[None]:
        """Errors about the local copy name the folder's URL instead (`Error: ... (s3://bucket/out/parts)`)."""
        try:
            yield
        except QbatchError as exc:
            local = str(self.path)
            if exc.where and exc.where.startswith(local):
                exc.where = str(self.url) + exc.where[len(local):]
            raise

    # -- closing ----------------------------------------------------------------
    def close(self) -> None:
        """Upload the rest, release the lock, remove the stage. LockedError: the lock was lost meanwhile."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self.lock is not None and not self._lost:
                if not self.lock.renew():
                    self._lost = "its lease lapsed and another run took the folder over"
                else:
                    self.push()
                    self.lock.release()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
        if self._lost:
            raise LockedError(f"this run lost the output folder's lock: {self._lost}", where=str(self.url),
                              hint="its last results were not uploaded; rerun to resume from what the folder holds")

    def discard(self) -> None:
        """Stop without uploading (the lock released if held): for a run that failed before writing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self.lock is not None and self.lock.held and not self._lost:
                self.lock.release()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@contextmanager
def viewed(url: str, *, thin: Thin | None = None) -> Iterator[StagedFolder]:
    """A local copy of the folder `url` to read (`qbatch status`, `report`, `merge`'s shards): no lock taken,
    nothing uploaded, removed afterwards; the objects `thin` names copied thin. A run writing there
    meanwhile may add parts the copy lacks."""
    staged = StagedFolder(Url.parse(url), locked=False, thin=thin).open()
    try:
        yield staged
    finally:
        staged.discard()


@contextmanager
def staged(url: str, *, keep_on_failure: bool = False, thin: Thin | None = None) -> Iterator[StagedFolder]:
    """A local copy of the folder `url` to write, under its lock, errors about it naming `url`; uploaded when
    the block ends without an error. When it fails, what it wrote goes up too with `keep_on_failure` (a run's
    parts, for its resume; the block's own error is the one raised), else nothing (`qbatch merge`'s output).
    The objects `thin` names are copied thin, for the block to fill() before it reads all their columns."""
    folder = StagedFolder(Url.parse(url), locked=True, thin=thin).open()
    try:
        with folder.naming_errors():
            yield folder
    except BaseException:
        if not keep_on_failure:
            folder.discard()
            raise
        with suppress(QbatchError):
            folder.close()
        raise
    folder.close()
