"""The output folder: atomic parts, manifest, done ids, lock, final files (the fingerprint the manifest
holds, and its check: fingerprint.py).

    OUT_DIR/
      .qbatch.lock          fcntl lock held by the live run (the OS drops it when the process dies);
                            it says who holds it and what that run is doing (its phase, for qbatch status)
      manifest.json         what was run (fingerprint), its status and counts
      stats.json            the last run's numbers
      parts/part-000001.parquet    results, one file per finished chunk
      parts/errors-000001.parquet  failed rows
      results.parquet, errors.parquet   assembled when a run completes

Every file is written to a temporary name, fsynced, then renamed, so a crash
leaves either the whole file or nothing (and the next start removes the
leftover temp). Resume is by row id, never by position.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from qbatch._fs import OUTPUT_LOCK, TMP_MARK, atomic_write, atomic_write_json, normal_path, output_error, output_os_errors
from qbatch.errors import CheckpointMismatch, LockedError, OutputError
from qbatch.output.done import DoneIds
from qbatch.output.fingerprint import Fingerprint
from qbatch.output.manifest import Manifest
from qbatch.output.reading import PART_HINT, reading
from qbatch.output.summary import Summary
from qbatch.output.telemetry import TELEMETRY_FILE, TELEMETRY_PARTS
from qbatch.storage.thin import Thin

LOCK_NAME = OUTPUT_LOCK
RESULT_PREFIX, ERROR_PREFIX = "part-", "errors-"
DUPLICATE_ID = "duplicate_id"  # the error of a row that --dedupe dropped
# What a run that failed before its first row leaves in a folder it found without it (undo_open): vLLM's
# output, which says why an engine did not start (session.py's ENGINE_LOG).
KEPT_ON_FAILURE = ("engine.log",)


def _read_for_ids(name: str) -> bool:
    """The files of OUT_DIR (`name` below it) of which a resume reads only ID_COLUMNS until it assembles, and
    `qbatch status` only those: the parts and the final tables."""
    folder, _, file = name.rpartition("/")
    if folder == "parts":
        return file.startswith((RESULT_PREFIX, ERROR_PREFIX)) and file.endswith(".parquet")
    return not folder and name in ("results.parquet", "errors.parquet")


# What a resume and `qbatch status` read of a part or a final table (done and failed ids, samples by id):
# an object store's folder is copied so, thin (storage/thin.py), and a resume fetches the rest to assemble.
ID_COLUMNS = ("id", "error", "sample_index")
IDS_ONLY = Thin(_read_for_ids, ID_COLUMNS)


class OutputDir:
    """One run's view of OUT_DIR; holds the lock from open() until close()."""

    def __init__(self, path: str | Path, *, make_whole: Callable[[Path], None] | None = None):
        """`make_whole(folder)`: where the parts may be thin copies (IDS_ONLY), what makes those in `folder` whole."""
        self.path = Path(normal_path(path))
        self.parts = self.path / "parts"
        self.make_whole = make_whole
        self._lock_fd: int | None = None
        self._holder = ""  # "pid N since ...": the lock file's first line while this object holds it
        self._found: set[str] | None = None  # what the folder held when opened (None: open() made it)
        self._last_number: dict[str, int] = {}  # per part prefix, once the folder was listed

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    # -- lifecycle ---------------------------------------------------------
    def open(self) -> OutputDir:
        """Create the folder, take the lock, remove temp files of killed runs."""
        if self.path.exists() and not self.path.is_dir():
            raise OutputError("output path exists and is not a folder", where=str(self.path),
                              hint="pass a folder with -o/--output-dir")
        with output_os_errors("create the output folder", self.path):
            self._found = set(os.listdir(self.path)) if self.path.is_dir() else None
            self.parts.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._remove_leftovers()
        except BaseException:
            self.close()  # the caller never gets this object to close
            raise
        return self

    def _remove_leftovers(self) -> None:
        for folder in (self.path, self.parts):
            with output_os_errors("remove temp files of a killed run", folder):
                for leftover in folder.glob(f"*{TMP_MARK}*"):
                    leftover.unlink(missing_ok=True)

    def undo_open(self) -> list[str]:
        """After a run that failed before writing any part: remove what it added to the folder (parts/,
        the lock, its manifest, a spooled stdin; the folder itself if it made it) so that the folder is
        as the run found it. Keeps KEPT_ON_FAILURE and returns the names of those it added (nothing is
        removed, [] returned, once a part exists: those rows are a resume's)."""
        if self._found is None and not self.path.is_dir() or self.part_files(RESULT_PREFIX) \
                or self.part_files(ERROR_PREFIX):
            return []
        found = self._found or set()
        kept = []
        with output_os_errors("remove what the failed run added", self.path):
            for entry in sorted(set(os.listdir(self.path)) - found):
                path = self.path / entry
                if entry in KEPT_ON_FAILURE:
                    kept.append(entry)
                elif path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            if self._found is None and not kept:
                self.path.rmdir()
        return kept

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the fcntl lock
            self._lock_fd = None

    def _lock(self) -> None:
        with output_os_errors("open the lock file", self.path / LOCK_NAME):
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").partition("\n")[0].strip()
            os.close(fd)
            raise LockedError(
                f"another qbatch run is using this output folder ({holder or 'pid unknown'})",
                where=str(self.path), hint="wait for it to finish, or use a different -o/--output-dir",
            ) from None
        self._lock_fd = fd
        self._holder = f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}"
        try:
            self._write_lock(self._holder)
        except OutputError:
            self.close()
            raise

    def set_phase(self, phase: str, *, model: str | None = None) -> None:
        """Say what the live run is doing (reading the inputs, starting the engine, generating), for
        `qbatch status`: in the lock file, under the holder's line, so that it goes with the run."""
        if self._lock_fd is not None:
            self._write_lock(f"{self._holder}\n{json.dumps({'phase': phase, 'model': model})}")

    def _write_lock(self, text: str) -> None:
        # The new text first, then the length: a reader sees the whole line or an unreadable one, never none.
        data, fd = text.encode(), self._lock_fd
        if fd is None:  # closed
            return
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        except OSError as exc:
            raise output_error("write the lock file", self.path / LOCK_NAME, exc) from None

    def lock_holder(self) -> str | None:
        """Who holds the run lock ("pid N since ..."), or None when no live run does."""
        live = self.live_run()
        return None if live is None else live[0]

    def live_run(self) -> tuple[str, dict[str, Any]] | None:
        """Who holds the run lock ("pid N since ...") and what it said it is doing (set_phase: phase,
        model; empty before it said or when unreadable), or None when no live run does."""
        path = self.path / LOCK_NAME
        if not path.exists():
            return None
        with output_os_errors("read the lock file", path):
            fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            holder, _, said = os.pread(fd, 4096, 0).decode(errors="replace").partition("\n")
            return holder.strip() or "unknown process", _said(said)
        finally:
            os.close(fd)

    # -- manifest ----------------------------------------------------------
    def manifest(self) -> Manifest | None:
        """manifest.json, its fields checked (reading.py); None when there is none."""
        return Manifest.read(self.manifest_path)

    def write_manifest(self, manifest: Manifest) -> None:
        atomic_write_json(self.manifest_path, manifest.save())

    def write_stats(self, summary: Summary) -> None:
        atomic_write_json(self.path / "stats.json", summary.save())

    def check_fingerprint(self, fingerprint: Fingerprint, *, restart: bool) -> Manifest | None:
        """The previous manifest if it matches; raise CheckpointMismatch if not; wipe on restart."""
        previous = self.manifest()
        if restart:
            self.wipe()
            return None
        if previous is None:
            if self.part_files(RESULT_PREFIX) or self.part_files(ERROR_PREFIX):
                raise CheckpointMismatch("output folder has parts but no manifest.json", where=str(self.path),
                                         hint="rerun with --restart to start over")
            return None
        changes = previous.fingerprint.changes(fingerprint)
        if changes:
            raise CheckpointMismatch(
                "output folder holds results of a different configuration: " + "; ".join(changes),
                where=str(self.path),
                hint="rerun with --restart to start this output over, or use a different -o/--output-dir",
            )
        return previous

    def wipe(self) -> None:
        self._last_number.clear()
        with output_os_errors("remove the previous results", self.path):
            shutil.rmtree(self.parts, ignore_errors=True)
            self.parts.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.path / TELEMETRY_PARTS, ignore_errors=True)
            # report.html: the page `qbatch report` / `run --report` writes, of the results wiped here
            for name in ("manifest.json", "stats.json", "results.parquet", "errors.parquet", "results.jsonl",
                         TELEMETRY_FILE, "report.html"):
                (self.path / name).unlink(missing_ok=True)

    # -- parts -------------------------------------------------------------
    def part_files(self, prefix: str) -> list[Path]:
        """Finished parts, in order. An unreadable parts/ is an error: Path.glob would list nothing,
        and every row would be redone."""
        try:
            names = [entry.name for entry in os.scandir(self.parts)]
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise output_error("list the parts", self.parts, exc) from None
        return sorted(self.parts / name for name in names
                      if name.startswith(prefix) and name.endswith(".parquet") and TMP_MARK not in name)

    def whole_part_files(self, prefix: str) -> list[Path]:
        """part_files, each with all its columns (for assembling or rewriting them): thin copies made whole."""
        if self.make_whole is not None:
            self.make_whole(self.parts)
        return self.part_files(prefix)

    def done_ids(self, *, include_errors: bool) -> DoneIds:
        """Ids with a result (and, unless errors are retried, with an error) in a finished part, as digests
        (done.py), read in one pass: a part's ids in memory at a time."""
        failed = self._error_id_lists() if include_errors else ()
        return DoneIds.of(chain.from_iterable(chain(self._result_id_lists(), failed)))

    def result_ids(self) -> DoneIds:
        """Ids with a result in a finished part, as digests."""
        return DoneIds.of(chain.from_iterable(self._result_id_lists()))

    def error_ids(self) -> DoneIds:
        """Ids recorded as failed in a finished part (some may have a result too, after --retry-errors), as digests."""
        return DoneIds.of(chain.from_iterable(self._error_id_lists()))

    def _result_id_lists(self) -> Iterator[list[str]]:
        for path in self.part_files(RESULT_PREFIX):
            yield self._read_part(path, ["id"]).column("id").to_pylist()

    def _error_id_lists(self) -> Iterator[list[str]]:
        """Each errors part's failed ids. A duplicate dropped by --dedupe is recorded under the id of the row
        that was kept, so that error does not make the id failed: a run killed before the kept row's result
        was written would otherwise never process it."""
        for path in self.part_files(ERROR_PREFIX):
            yield self._failed_ids(path)

    def _failed_ids(self, path: Path) -> list[str]:
        table = self._read_part(path, ["id", "error"])
        kept = pc.invert(pc.fill_null(pc.equal(table.column("error"), DUPLICATE_ID), False))
        ids: list[str] = table.column("id").filter(kept).to_pylist()
        return ids

    @staticmethod
    def _read_part(path: Path, columns: list[str]) -> pa.Table:
        with reading(path, PART_HINT):
            return pq.read_table(path, columns=columns)

    def write_part(self, prefix: str, table: pa.Table) -> Path:
        path = self.parts / f"{prefix}{self._next_number(prefix):06d}.parquet"
        atomic_write(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))
        return path

    def _next_number(self, prefix: str) -> int:
        # List the folder once, then count: listing it for every part makes writing n parts
        # O(n^2). The lock makes this process the only writer.
        if prefix not in self._last_number:
            existing = self.part_files(prefix)
            self._last_number[prefix] = int(existing[-1].stem.removeprefix(prefix)) if existing else 0
        self._last_number[prefix] += 1
        return self._last_number[prefix]


def _said(text: str) -> dict[str, Any]:
    """The live run's phase and model from its lock file's second line; {} if it is missing or half written."""
    try:
        said = json.loads(text)
    except ValueError:
        return {}
    return said if isinstance(said, dict) else {}
