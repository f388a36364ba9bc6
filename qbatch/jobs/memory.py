"""Process memory housekeeping for runs that stream millions of rows through Python."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def rare_collections() -> Iterator[None]:
    """Run Python's cyclic garbage collector less often while rows stream through.

    Every row in flight is a few container objects, and with the default thresholds a full
    collection, which scans every object (transformers' and Arrow's too), runs every few
    thousand rows. Rows form no reference cycles, so collecting less often holds no more
    memory (docs/benchmarks.md, "Figures behind the code", has the cost saved).
    """
    before = gc.get_threshold()
    gc.set_threshold(50_000, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def release_freed_memory() -> None:
    """Hand memory the windows used back to the OS before the final assembly takes its own.

    glibc keeps freed blocks in its per-thread arenas (the stages', the tokenizer's), which the
    assembly's peak would come on top of. Without glibc: nothing.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
