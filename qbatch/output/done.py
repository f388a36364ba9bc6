"""The ids a folder's parts hold (done, failed), kept as 16-byte digests: what a resumed run skips.

A resumed run of 100M rows cannot hold the done ids as Python strings (~90 bytes each in a set):
each id is a 16-byte blake2b digest, in two sorted arrays of 8-byte halves (16 bytes a done row),
and an id is done when its digest is there. A new id shares a done one's 16-byte digest about once
in 10^22 runs of 100M done and 100M new rows (10^16 pairs, each 2^-128): unlike the pre-scan's 8-byte
digests (jobs/ids.py), which a second reading checks, these are taken as the ids (docs/benchmarks.md,
"memory per row").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

DIGEST_BYTES = 16


def _halves(rid: str) -> tuple[int, int]:
    digest = hashlib.blake2b(rid.encode(), digest_size=DIGEST_BYTES).digest()
    return int.from_bytes(digest[:8], "big"), int.from_bytes(digest[8:], "big")


class DoneIds:
    """A set of ids by their digests: `in`, len, | and - as a set of strings has them; built once, never changed."""

    __slots__ = ("_hi", "_lo")

    def __init__(self, hi: np.ndarray | None = None, lo: np.ndarray | None = None):
        """From halves already sorted by (hi, lo) and unique; none: the empty set."""
        self._hi = np.empty(0, dtype=np.uint64) if hi is None else hi
        self._lo = np.empty(0, dtype=np.uint64) if lo is None else lo

    @classmethod
    def of(cls, ids: Iterable[str | None]) -> DoneIds:
        """The digests of `ids` (None skipped): 16 bytes each as they are read, then sorted (at most
        ~32 bytes an id meanwhile: each step frees what the next copies)."""
        packed = bytearray()
        for rid in ids:
            if rid is not None:
                packed += hashlib.blake2b(rid.encode(), digest_size=DIGEST_BYTES).digest()
        halves = np.frombuffer(packed, dtype=">u8").reshape(-1, 2)
        hi, lo = halves[:, 0].astype(np.uint64), halves[:, 1].astype(np.uint64)
        del halves
        packed.clear()
        return cls._unique(hi, lo)

    @classmethod
    def _unique(cls, hi: np.ndarray, lo: np.ndarray) -> DoneIds:
        order = np.lexsort((lo, hi))
        hi = hi[order]
        lo = lo[order]
        del order
        if len(hi) > 1:
            first = np.ones(len(hi), dtype=bool)
            first[1:] = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
            if not first.all():
                hi, lo = hi[first], lo[first]
        return cls(hi, lo)

    def __len__(self) -> int:
        return len(self._hi)

    def __contains__(self, rid: object) -> bool:
        if not len(self._hi) or not isinstance(rid, str):
            return False
        hi, lo = _halves(rid)
        i = int(np.searchsorted(self._hi, np.uint64(hi)))
        while i < len(self._hi) and int(self._hi[i]) == hi:
            if int(self._lo[i]) == lo:
                return True
            i += 1
        return False

    def __or__(self, other: DoneIds) -> DoneIds:
        if not len(other):
            return self
        if not len(self):
            return other
        return self._unique(np.concatenate([self._hi, other._hi]), np.concatenate([self._lo, other._lo]))

    def __sub__(self, other: DoneIds) -> DoneIds:
        """Those not in `other`."""
        if not len(other) or not len(self):
            return self
        keep = ~other._members(self._hi, self._lo)
        return DoneIds(self._hi[keep], self._lo[keep])

    def _members(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """Which of the digests (hi, lo) are here, at once: by the first half, then the second (a first
        half that two digests share, about never, looked at one by one)."""
        left, right = np.searchsorted(self._hi, hi, "left"), np.searchsorted(self._hi, hi, "right")
        found = (right - left == 1) & (self._lo[np.minimum(left, len(self._lo) - 1)] == lo)
        for i in np.flatnonzero(right - left > 1):
            found[i] = bool((self._lo[left[i]:right[i]] == lo[i]).any())
        return np.asarray(found, dtype=bool)

    def __repr__(self) -> str:
        return f"DoneIds({len(self)} ids)"

