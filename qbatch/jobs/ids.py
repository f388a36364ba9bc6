"""What exactly-once needs to know of every row, kept small: 8-byte digests of the row ids.

A run of 100M rows cannot hold 100M id strings (a Python string in a set costs ~90 bytes): the
pre-scan logs each row's id as an 8-byte blake2b digest in flat arrays (8 bytes a row) and sorts
them once to find the digests that repeat. Only those are looked at again, as strings, in a second
reading of the inputs: a repeated digest is a duplicated id, or (about once in 3,000 runs of 100M
rows) two ids that share a digest, which the strings tell apart. So duplicate ids are refused (or
dropped by --dedupe) exactly, and what a run holds per row is its digest (docs/benchmarks.md,
"memory per row").
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

import numpy as np

BLOCK_ROWS = 1 << 20  # digests per block: the log grows by blocks, never copying what it holds


def id_digest(rid: str) -> int:
    """The id's 8-byte digest, as an int (the one in_shard takes its shard from)."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "big")


class DigestLog:
    """Digests, in the order they come: 8 bytes each, in blocks."""

    def __init__(self) -> None:
        self._blocks: list[array[int]] = [array("Q")]

    def add(self, digest: int) -> None:
        block = self._blocks[-1]
        if len(block) >= BLOCK_ROWS:
            block = array("Q")
            self._blocks.append(block)
        block.append(digest)

    def __len__(self) -> int:
        return sum(len(block) for block in self._blocks)

    def repeated(self) -> set[int]:
        """The digests logged more than once (sorted once: 8 more bytes a row, for the sort's time)."""
        values = np.concatenate([np.frombuffer(block, dtype=np.uint64) for block in self._blocks if len(block)]
                                or [np.empty(0, dtype=np.uint64)])
        values.sort()
        twice = values[1:][values[1:] == values[:-1]]
        return {int(d) for d in np.unique(twice)}


@dataclass
class RepeatedIds:
    """The ids to do that the pre-scan found more than once, by digest (None: no pre-scan yet): the only
    rows --dedupe must remember as it goes, to keep the first of each. Filled by the pre-scan, read
    by the windows, which start after it in a --dedupe run."""

    digests: set[int] | None = None
