"""What an output folder's results depend on (manifest.json's "fingerprint"), as typed records read and
written the same way by every module: the result-changing settings, the model, and each input's
identity (its size and SHA-256).

A rerun whose fingerprint differs refuses to mix its results with the folder's (folder.py), except
that an uncompressed JSONL input may have grown by whole lines (rows appended: they resume). Shards
are merged only when their fingerprints agree (merge.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from qbatch.output.record_files import NOT_IN_FILE, SHAPE
from qbatch.spec import COMPRESSED_SUFFIXES

HASH_BLOCK_BYTES = 1 << 20
MAX_NAMED = 5  # inputs a mismatch names (a folder may hold thousands): then how many more


@dataclass(frozen=True)
class InputPrefix:
    """The first `size` bytes of an input that grew (what the previous run read), hashed in the same pass."""

    size: int
    sha256: str
    line_ended: bool = False  # the bytes after the prefix start with a newline


@dataclass(frozen=True)
class InputIdentity:
    """One input as a run read it: `size` bytes hashing to `sha256` (None: recorded by an older qbatch
    that hashed only the file's start and end). `prefix` is this run's own, never recorded. A manifest
    may lack what the defaults fill (an older qbatch's)."""

    path: str
    format: str = ""
    size: int = 0
    sha256: str | None = None
    ends_with_newline: bool = False
    prefix: InputPrefix | None = field(default=None, compare=False, metadata=NOT_IN_FILE)


@dataclass(frozen=True)
class Fingerprint:
    """What the results depend on: settings (JobSpec.result_settings and what Job.fingerprint adds), the
    model's identity, and the inputs'."""

    settings: dict[str, Any] = field(default_factory=dict, metadata={SHAPE: {"shard": (str, None)}})
    model: dict[str, Any] = field(default_factory=dict)
    inputs: tuple[InputIdentity, ...] = ()

    @property
    def shard(self) -> str | None:
        """The --shard I/N the run took, None for a whole job."""
        return self.settings.get("shard")

    def as_job(self) -> Fingerprint:
        """The job, whatever its shard and its inputs' state: its settings (no shard) and model."""
        return Fingerprint({k: v for k, v in self.settings.items() if k != "shard"}, self.model)

    def without_shard(self) -> Fingerprint:
        """The fingerprint of the whole job its shards make (a merge's)."""
        return replace(self, settings={**self.settings, "shard": None})

    def seen_sizes(self) -> dict[str, int]:
        """Each input's size (by path) as this fingerprint's run read it."""
        return {i.path: i.size for i in self.inputs}

    def changes(self, new: Fingerprint) -> list[str]:
        """What differs from this (the folder's) to `new`, in words. Inputs may only have grown (appended rows)."""
        changes = []
        for key in sorted(set(self.settings) | set(new.settings)):
            before, after = self.settings.get(key), new.settings.get(key)
            if before != after:
                changes.append(f"{key} was {before!r}, now {after!r}")
        if self.model != new.model:
            changes.append(f"model was {self.model or None}, now {new.model or None}")
        old_paths, new_paths = [i.path for i in self.inputs], [i.path for i in new.inputs]
        if old_paths != new_paths:
            changes.append(paths_change(old_paths, new_paths))
        else:
            changed = [f"input {after.path} changed (not only appended to): {reason}"
                       for before, after in zip(self.inputs, new.inputs, strict=True)
                       if (reason := input_change(before, after))]
            changes += changed[:MAX_NAMED]
            if len(changed) > MAX_NAMED:
                changes.append(f"and {len(changed) - MAX_NAMED:,} more inputs changed")
        return changes


def paths_change(old: list[str], new: list[str]) -> str:
    """How a run's list of inputs differs from an earlier one's, in a line whatever their number (a folder
    of 10,000 files): how many were added and removed, the first MAX_NAMED of each named."""
    old_set, new_set = set(old), set(new)
    added, removed = [p for p in new if p not in old_set], [p for p in old if p not in new_set]
    said = [f"{_count(len(paths), 'input')} {what} ({_first(paths)})"
            for paths, what in ((added, "added"), (removed, "removed")) if paths]
    if not said:
        return f"the same {_count(len(new), 'input')} in another order"
    return f"inputs were {_count(len(old), 'file')}, now {len(new):,}: " + ", ".join(said)


def _first(paths: list[str]) -> str:
    shown = ", ".join(paths[:MAX_NAMED])
    return shown if len(paths) <= MAX_NAMED else f"{shown} and {len(paths) - MAX_NAMED:,} more"


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def input_identity(path: Path, fmt: str, *, seen_size: int | None = None, size: int | None = None) -> InputIdentity:
    """Size and SHA-256 of the file's first `size` bytes (None: the whole file), read once, block by block.

    `size` is what the run reads as rows (readers.rows_size: a JSONL file's last line that a writer is
    still writing is left for a later run, and is no part of this run's input). Any changed byte,
    anywhere, changes the hash: a hash of the start and end alone let a row edited in the middle of
    a large file resume (and double). With `seen_size`, the size the previous run hashed, the same
    pass also hashes the first `seen_size` bytes ("prefix"): when that equals the previous hash, the
    file only grew; the prefix also says whether the bytes after it start with a newline (a last
    line the previous run read without its newline then ended unchanged).
    """
    whole = hashlib.sha256()
    head_sha256: str | None = None
    read, last_byte, line_ended = 0, b"", False
    with open(path, "rb") as handle:
        while block := handle.read(HASH_BLOCK_BYTES if size is None else min(HASH_BLOCK_BYTES, size - read)):
            if seen_size is not None and head_sha256 is None and read + len(block) >= seen_size:
                head = whole.copy()
                head.update(block[:seen_size - read])
                head_sha256 = head.hexdigest()
            whole.update(block)
            read += len(block)
            last_byte = block[-1:]
        if head_sha256 is not None and seen_size is not None and seen_size != read:
            handle.seek(seen_size)
            line_ended = handle.read(2).startswith((b"\n", b"\r\n"))
    prefix = InputPrefix(seen_size, head_sha256, line_ended) \
        if head_sha256 is not None and seen_size is not None and seen_size != read else None
    return InputIdentity(str(path.resolve()), fmt, read, whole.hexdigest(), last_byte == b"\n", prefix)


def may_grow(path: str | Path, fmt: str) -> bool:
    """Only uncompressed JSONL files may grow between runs (rows appended); other inputs must stay as they were."""
    return fmt == "jsonl" and not str(path).lower().endswith(COMPRESSED_SUFFIXES)


def input_change(old: InputIdentity, new: InputIdentity) -> str | None:
    """Why `new` cannot resume the results of `old`, or None: unchanged, or an uncompressed
    JSONL file that only grew by whole lines (its old bytes intact, its old last line ended,
    or ended now by the newline that follows it)."""
    if old.sha256 is None:
        return "the output was made by an older qbatch that hashed only the file's start and end"
    if old.format != new.format:
        return f"format was {old.format}, now {new.format}"
    if (old.size, old.sha256) == (new.size, new.sha256):
        return None
    if new.size < old.size:
        return f"it shrank from {old.size:,} to {new.size:,} bytes"
    if new.size == old.size:
        return f"same size ({new.size:,} bytes), different content"
    if not may_grow(old.path, old.format):
        return f"it grew from {old.size:,} to {new.size:,} bytes; only uncompressed JSONL files may grow"
    prefix = new.prefix
    if prefix is None or prefix.size != old.size:  # two manifests compared (merge): no prefix hash
        return f"it grew from {old.size:,} to {new.size:,} bytes"
    if prefix.sha256 != old.sha256:
        return f"its first {old.size:,} bytes (what the last run read) differ"
    if old.size and not old.ends_with_newline and not prefix.line_ended:
        return "rows were appended to a file that did not end with a newline, so its last row changed"
    return None
