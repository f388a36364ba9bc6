"""The output folder's lock in an object store (storage/lock.py), against moto's S3 server: one holder at a
time however runs race, a lapsed lease taken over by exactly one run, a holder that lost it told so."""

from __future__ import annotations

import threading
import time

import pytest

from qbatch.errors import LockedError
from qbatch.storage.lock import LEASE_ENV, RemoteLock, live_holder
from qbatch.storage.store import Store
from qbatch.storage.urls import Url


@pytest.fixture
def folder(bucket):
    return Url.parse(f"s3://{bucket}/out")


def test_the_store_honours_the_conditional_writes_the_lock_relies_on(folder):
    store = Store(folder)
    url = folder.child("x")
    first = store.create(url, b"1")
    assert first is not None and store.create(url, b"2") is None  # If-None-Match: *
    second = store.replace(url, b"3", first)
    assert second is not None and store.replace(url, b"4", first) is None  # If-Match: a stale ETag
    assert store.read(url)[0] == b"3"


def test_of_runs_racing_for_the_lock_one_wins(folder):
    locks = [RemoteLock(Store(folder), folder) for _ in range(8)]
    start = threading.Barrier(len(locks))
    outcomes: list[str] = []

    def take(lock: RemoteLock) -> None:
        start.wait()
        try:
            lock.acquire()
            outcomes.append("won")
        except LockedError as exc:
            outcomes.append(str(exc))

    threads = [threading.Thread(target=take, args=(lock,)) for lock in locks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("won") == 1, outcomes
    assert all("another qbatch run" in o for o in outcomes if o != "won")
    winner = next(lock for lock in locks if lock.held)
    assert live_holder(Store(folder), folder) is not None
    winner.release()
    assert live_holder(Store(folder), folder) is None
    RemoteLock(Store(folder), folder).acquire()  # a released lock is free


def test_a_lapsed_lease_is_taken_over_once_and_its_holder_learns_it_lost(folder, monkeypatch):
    monkeypatch.setenv(LEASE_ENV, "0.5")
    dead = RemoteLock(Store(folder), folder)
    dead.acquire()  # then it stops renewing, as a killed run does
    with pytest.raises(LockedError, match=r"another qbatch run is using this output folder \(pid \d+ on "):
        RemoteLock(Store(folder), folder).acquire()
    time.sleep(0.7)
    takers = [RemoteLock(Store(folder), folder) for _ in range(4)]
    won = 0
    for taker in takers:
        try:
            taker.acquire()
            won += 1
        except LockedError:
            pass
    assert won == 1
    assert not dead.renew()  # its next renewal fails: it stops writing
    assert next(t for t in takers if t.held).renew()
