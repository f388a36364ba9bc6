"""Files and batches in SQLite: the embedded default, WAL mode, one connection behind one lock.

Every write goes through this one connection (one writer); a state change and the files it
hands out are one transaction, so a file is never listed before its bytes are on disk whole
(written to a temporary name, fsynced and renamed first) and a crash leaves either the old
state or the new one. A batch row holds its OpenAI object as JSON next to the columns queried.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Callable, Sequence
import threading
from pathlib import Path
from typing import Any

from qbatch.serve.objects import PENDING, TERMINAL, Batch, StoredFile

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, purpose TEXT NOT NULL,
    filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, path TEXT NOT NULL,
    num_requests INTEGER);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, status TEXT NOT NULL,
    input_file_id TEXT NOT NULL, object TEXT NOT NULL);
"""


class Store:
    def __init__(self, path: Path):
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.RLock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a state change survives a power cut, not only kill -9
            self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- files -------------------------------------------------------------
    def add_file(self, record: StoredFile) -> None:
        with self._lock:
            self._db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at, path, num_requests) "
                             "VALUES (:id, :purpose, :filename, :bytes, :created_at, :path, :num_requests)",
                             dataclasses.asdict(record))

    def file(self, file_id: str) -> StoredFile | None:
        with self._lock:
            row = self._db.execute("SELECT id, purpose, filename, bytes, created_at, path, num_requests "
                                   "FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else StoredFile(*row)

    def files(self, *, purpose: str | None, limit: int, after: str | None) -> tuple[list[StoredFile], bool]:
        """Newest first; `after`: the id the previous page ended with."""
        query = f"SELECT {', '.join(_FILE_COLUMNS)} FROM files WHERE 1=1"
        args: list[Any] = []
        if purpose:
            query += " AND purpose = ?"
            args.append(purpose)
        if after:
            query += " AND seq < (SELECT seq FROM files WHERE id = ?)"
            args.append(after)
        query += " ORDER BY seq DESC LIMIT ?"
        args.append(limit + 1)
        with self._lock:
            rows = [StoredFile(*row) for row in self._db.execute(query, args)]
        return rows[:limit], len(rows) > limit

    def delete_file(self, file_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))

    def batches_reading(self, file_id: str) -> list[str]:
        """Unfinished batches whose input is this file."""
        with self._lock:
            rows = self._db.execute(f"SELECT id FROM batches WHERE input_file_id = ? AND status NOT IN "
                                    f"({', '.join('?' * len(TERMINAL))})", (file_id, *sorted(TERMINAL)))
            return [row[0] for row in rows]

    # -- batches -----------------------------------------------------------
    def add_batch(self, batch: Batch) -> None:
        with self._lock:
            self._db.execute("INSERT INTO batches (id, status, input_file_id, object) VALUES (?, ?, ?, ?)",
                             (batch.id, batch.status, batch.input_file_id, json.dumps(batch.save())))

    def batch(self, batch_id: str) -> Batch | None:
        with self._lock:
            row = self._db.execute("SELECT object FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else Batch.load(json.loads(row[0]))

    def batches(self, *, limit: int, after: str | None) -> tuple[list[Batch], bool]:
        """Newest first, as OpenAI lists them; `after`: the id the previous page ended with."""
        query, args = "SELECT object FROM batches", []
        if after:
            query += " WHERE seq < (SELECT seq FROM batches WHERE id = ?)"
            args.append(after)
        with self._lock:
            rows = [Batch.load(json.loads(r[0]))
                    for r in self._db.execute(query + " ORDER BY seq DESC LIMIT ?", (*args, limit + 1))]
        return rows[:limit], len(rows) > limit

    def pending(self) -> list[Batch]:
        """Batches the worker still has to act on, oldest first (the queue, FIFO)."""
        with self._lock:
            rows = self._db.execute(f"SELECT object FROM batches WHERE status IN ({', '.join('?' * len(PENDING))}) "
                                    "ORDER BY seq", PENDING)
            return [Batch.load(json.loads(r[0])) for r in rows]

    def update_batch(self, batch_id: str, change: Callable[[Batch], Batch], *,
                     new_files: Sequence[StoredFile] = ()) -> Batch:
        """Apply `change` to a batch (and add the files it hands out) in one transaction; a batch that has
        ended (TERMINAL) is returned as it is when `change` would change its status."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                stored = Batch.load(json.loads(self._db.execute("SELECT object FROM batches WHERE id = ?",
                                                                (batch_id,)).fetchone()[0]))
                batch = change(stored)
                if stored.status in TERMINAL and batch.status != stored.status:
                    self._db.execute("ROLLBACK")  # an ended batch never changes status (nor hands out files)
                    return stored
                self._db.execute("UPDATE batches SET status = ?, object = ? WHERE id = ?",
                                 (batch.status, json.dumps(batch.save()), batch_id))
                for record in new_files:
                    self.add_file(record)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return batch


_FILE_COLUMNS = ("id", "purpose", "filename", "bytes", "created_at", "path", "num_requests")  # StoredFile's
