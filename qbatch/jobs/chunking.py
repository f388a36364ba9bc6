"""Chunking: sort requests by length inside a bounded window, cut token-budgeted chunks.

Pure functions, no I/O and no vLLM. A window bounds memory (only it and the
chunks cut from it are ever materialised; windows grow from FIRST_WINDOW rows
so generation starts early, and the rows left at the end join the last one, see
Job._row_windows); sorting inside it starts the longest rows first
and puts rows of similar length in one chunk, so they finish at about the same
time; the token budget (prompt + max_tokens) bounds the work a chunk
represents, which is what a crash can cost. Under --order longest-first, rows that share a
long prompt prefix (prefixes.py) are kept together, in one chunk, so they run close in time
and on one engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from qbatch.jobs.prefixes import grouped
from qbatch.records import Request

# Rows in the first window; windows then double up to sort_window, so generation starts early: an
# engine already up waits for the first window's encode before its first step (docs/benchmarks.md,
# "the first window"), while sorting within small early windows costs the order little
# (benchmarks/simulate_order.py).
FIRST_WINDOW = 64
# Rows whose prompts tell whether the job's rows share documents (Job._row_windows): read and rendered,
# not encoded, before the first window.
DOCUMENT_SAMPLE = 512


def sort_window(requests: list[Request]) -> list[Request]:
    """Longest first: the most output tokens allowed, then the longest prompt.

    A row's time in the engine is its decode steps, so rows that may generate most start
    first and the short ones fill in around them; a long row started last would run
    almost alone at the end (a simulation of the `varied` benchmark: 1,024 steps instead
    of 1,252). With one max_tokens for every row this is longest prompt first.
    """
    return sorted(requests, key=length_key, reverse=True)


def length_key(request: Request) -> tuple[int, int]:
    return request.sampling["max_tokens"], request.num_prompt_tokens


def order_groups(requests: list[Request], order: str) -> list[list[Request]]:
    """The window in the job's --order, as groups that cut_group_chunks keeps in one chunk each:
    "longest-first" (rows sharing a long prefix together, each group longest first, groups by
    their longest row: prefixes.py), "longest-first-flat" (sort_window) or "input" (as read),
    one row a group for the last two."""
    if order == "longest-first":
        return grouped(requests, length_key)
    return [[r] for r in (sort_window(requests) if order == "longest-first-flat" else requests)]


def by_adapter(groups: list[list[Request]], max_loras: int) -> list[list[Request]]:
    """The window's groups with each LoRA adapter's rows together, where that helps vLLM: only when the
    window names more adapters than one batch can mix (max_loras). Then a batch of mixed rows would make
    vLLM swap adapters in and out of its slots as rows come and go; grouped, a chunk mostly needs a few.
    The sort is stable: each adapter's rows keep their length order (the base model's rows first), and
    windows stay in order, so rows of one window still go before the next window's. With no more adapters
    than slots the window keeps its longest-first order: vLLM runs their rows in one batch anyway. A group of
    rows sharing a prefix goes by its first row's adapter."""
    names = {r.adapter for group in groups for r in group} - {None}
    if len(names) <= max_loras:
        return groups
    return sorted(groups, key=lambda group: (group[0].adapter is not None, group[0].adapter or ""))


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



def cut_group_chunks(groups: Iterable[list[Request]], chunk_tokens: int) -> Iterator[list[Request]]:
    """Chunks as cut_chunks cuts them, but a group goes whole into one chunk (which is cut before
    it rather than split): chunks go to whichever engine asks next, and a group's rows share a
    prefix that only the engine that computed it has cached. A group over the budget on its own
    is cut by the budget; its last piece starts the next chunk.
    """
    chunk: list[Request] = []
    used = 0
    for group in groups:
        cost = sum(r.cost for r in group)
        if chunk and used + cost > chunk_tokens:
            yield chunk
            chunk, used = [], 0
        if cost <= chunk_tokens:
            chunk.extend(group)
            used += cost
            continue
        *full, chunk = cut_chunks(group, chunk_tokens)
        yield from full
        used = sum(r.cost for r in chunk)
    if chunk:
        yield chunk
