"""Planning: sort requests by length inside a bounded window, cut token-budgeted chunks.

Pure functions, no I/O and no vLLM. A window bounds memory (only it and the
chunks cut from it are ever materialised; windows grow from FIRST_WINDOW rows
so generation starts early, and the rows left at the end join the last one, see
Job._row_windows); sorting inside it starts the longest rows first
and puts rows of similar length in one chunk, so they finish at about the same
time; the token budget (prompt + max_tokens) bounds the work a chunk
represents, which is what a crash can cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from qbatch.records import Request

# Rows in the first window; windows then double up to sort_window, so generation starts early.
FIRST_WINDOW = 512


def sort_window(requests: list[Request]) -> list[Request]:
    """Longest first: the most output tokens allowed, then the longest prompt.

    A row's time in the engine is its decode steps, so rows that may generate most start
    first and the short ones fill in around them; a long row started last would run
    almost alone at the end (a simulation of the `varied` benchmark: 1,024 steps instead
    of 1,252). With one max_tokens for every row this is longest prompt first.
    """
    return sorted(requests, key=lambda r: (r.sampling["max_tokens"], r.num_prompt_tokens), reverse=True)


def order_window(requests: list[Request], order: str) -> list[Request]:
    """The window in the job's --order: "longest-first" (sort_window) or "input" (as read)."""
    return sort_window(requests) if order == "longest-first" else requests


def cut_chunks(requests: Iterable[Request], chunk_tokens: int) -> Iterator[list[Request]]:
    """Consecutive chunks whose total cost stays within `chunk_tokens`.

    A single request larger than the budget gets a chunk of its own rather
    than being dropped; it is validated against max_model_len elsewhere.
    """
    chunk: list[Request] = []
    used = 0
    for request in requests:
        if chunk and used + request.cost > chunk_tokens:
            yield chunk
            chunk, used = [], 0
        chunk.append(request)
        used += request.cost
    if chunk:
        yield chunk

