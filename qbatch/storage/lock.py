"""The lock of an output folder in an object store: the object `.qbatch.lock`, made with a conditional write.

A local folder's lock is an fcntl lock the OS drops when its holder dies; an object store has none, so the
lock is a lease. A run takes it by creating the object only if there is none (`If-None-Match: *`), saying
who holds it and until when (host, pid, start, lease end), and renews the lease every LEASE_S / 4
(stage.py's sync) by replacing the object only if it is still the version it wrote (`If-Match: ETAG`).
Another run finds it held until the lease ends; after that (its holder died: killed, machine lost) it
takes the lock over by replacing that version, so of two runs that find the same lapsed lease, one wins.
A holder whose renewal fails has lost the lock (its lease lapsed and another took it): it stops writing.
Releasing writes the lock as released, conditionally too. Leases are compared on the machines' clocks:
they are to agree within a few seconds (NTP), far less than LEASE_S.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass

from qbatch._fs import OUTPUT_LOCK
from qbatch.errors import LockedError
from qbatch.log import log
from qbatch.storage.store import Store
from qbatch.storage.urls import Url

LEASE_S = 60.0
LEASE_ENV = "QBATCH_LOCK_LEASE_S"  # another lease (seconds): a shorter one lets a dead run's folder be resumed sooner


def lease_s() -> float:
    return float(os.environ.get(LEASE_ENV) or LEASE_S)


@dataclass(frozen=True)
class Holder:
    """What the lock object says: who holds it and until when (seconds since the epoch)."""

    host: str
    pid: int
    since: str
    lease_until: float
    released: bool = False

    @classmethod
    def me(cls, lease: float, since: str | None = None) -> Holder:
        return cls(socket.gethostname(), os.getpid(), since or time.strftime("%Y-%m-%dT%H:%M:%S"), time.time() + lease)

    @classmethod
    def load(cls, data: bytes) -> Holder | None:
        try:
            found = json.loads(data)
            return cls(str(found["host"]), int(found["pid"]), str(found["since"]), float(found["lease_until"]),
                       bool(found.get("released")))
        except (ValueError, KeyError, TypeError):
            return None  # not a lock qbatch wrote (or half of one): taken over as a lapsed one

    def dump(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    def live(self) -> bool:
        return not self.released and self.lease_until > time.time()

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host} since {self.since}"


class RemoteLock:
    """The lease on one output folder's lock object, held from acquire() until release()."""

    def __init__(self, store: Store, folder: Url):
        self.store, self.url = store, folder.child(OUTPUT_LOCK)
        self.lease = lease_s()
        self._etag: str | None = None
        self._me = Holder.me(self.lease)

    @property
    def held(self) -> bool:
        return self._etag is not None

    def acquire(self) -> None:
        """Take the lock, or LockedError naming its live holder."""
        self._etag = self.store.create(self.url, self._me.dump())
        if self._etag is not None:
            return
        found = self.store.read(self.url)
        if found is None:  # released and removed between the two calls: try once more
            self._etag = self.store.create(self.url, self._me.dump())
        else:
            holder = Holder.load(found[0])
            if holder is not None and holder.live():
                raise _locked(holder, self.url)
            self._etag = self.store.replace(self.url, self._me.dump(), found[1])
            if self._etag is not None and holder is not None and not holder.released:
                log.warning(f"took over {self.url.child('..')}: its run ({holder}) stopped renewing its lease")
        if self._etag is None:
            raise LockedError("another qbatch run took this output folder at the same moment",
                              where=str(self.url), hint="wait for it to finish, or use a different -o/--output-dir")

    def renew(self) -> bool:
        """Extend the lease; False when the lock is no longer this run's (taken over after a lapse)."""
        if self._etag is None:
            return False
        self._me = Holder.me(self.lease, self._me.since)
        self._etag = self.store.replace(self.url, self._me.dump(), self._etag)
        return self._etag is not None

    def release(self) -> None:
        if self._etag is not None:
            released = Holder(self._me.host, self._me.pid, self._me.since, time.time(), released=True)
            self.store.replace(self.url, released.dump(), self._etag)
            self._etag = None


def live_holder(store: Store, folder: Url) -> Holder | None:
    """The run that holds the folder's lock now, None when none does."""
    found = store.read(folder.child(OUTPUT_LOCK))
    holder = None if found is None else Holder.load(found[0])
    return holder if holder is not None and holder.live() else None


def _locked(holder: Holder, url: Url) -> LockedError:
    left = max(holder.lease_until - time.time(), 0)
    return LockedError(f"another qbatch run is using this output folder ({holder})", where=str(url),
                       hint=f"wait for it to finish, or use a different -o/--output-dir; if that run died, "
                            f"its lease lapses in {left:.0f}s and a rerun then takes the folder over")
