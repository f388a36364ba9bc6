"""Prefix groups: rows of a window that share a long token prefix (a document asked several
questions), found by hashing their prompts' first tokens at a few depths.

vLLM keeps the KV blocks of a prefix it has computed for as long as no other request needs
the room: rows of one document run close in time compute the document once, rows scattered
through a window compute it again each (1.55x-1.96x for raw vLLM, issue #19; BatchLLM,
arXiv 2412.03594, orders rows the same way). A prefix shared by very many rows (a chat
template's head, a system prompt every row has) is reused so often that it stays cached
whatever the order, so it makes no group: a row's group is its prefix at the shallowest
depth that at most MAX_GROUP_ROWS rows, and at most MAX_GROUP_SHARE of the window's rows,
share, when at least two do.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from qbatch.records import PromptText, Request

# Depths (tokens) at which prompts are compared; the shallowest is the shortest prefix worth a
# group (8 of vLLM's 16-token KV blocks). A document is found when a depth falls between the
# end of the prefix every row has and the document's end: every 128 tokens up to 2,048, then
# doubling. Each prefix's hash builds on the one before, so the hashing is one pass over a
# prompt's first 16,384 tokens at most, in C (tuple slices); the counting one dict a depth.
PREFIX_DEPTHS = (*range(128, 2048, 128), 2048, 4096, 8192, 16384)
# A prefix shared by more rows than this stays in vLLM's cache in any order (it is reused all
# the time): grouping by it would only undo the length sort. The share keeps a prefix that
# (nearly) every row of a small window has, such as a system prompt, from being one group.
MAX_GROUP_ROWS = 256
MAX_GROUP_SHARE = 0.5
# A prompt given as its text is compared at the same depths in characters (a token is ~4 characters of
# English): before tokenizing, to see whether a job's rows share documents (Job._row_windows), and for the
# rows that travel as their text (records.PromptText), whose ids the driver never makes a list of.
CHARS_PER_TOKEN = 4

Key = Callable[[Request], Any]


def prefix_labels(prompts: Sequence[Sequence[Any]], *, depths: Sequence[int] = PREFIX_DEPTHS,
                  max_group_rows: int = MAX_GROUP_ROWS) -> list[int | None]:
    """Each prompt's group (a prefix hash), or None for a prompt that shares no prefix worth a group.

    A prompt is its token ids, or its text (compared at CHARS_PER_TOKEN times the depths); a text and
    a list of ids never share a prefix."""
    levels: list[list[int | None]] = [[None] * len(prompts) for _ in depths]
    char_depths = [CHARS_PER_TOKEN * depth for depth in depths]
    for i, prompt in enumerate(prompts):
        text = isinstance(prompt, str)
        digest, start = 0, 0
        for level, depth in enumerate(char_depths if text else depths):
            if len(prompt) < depth:
                break
            part = prompt[start:depth] if text else tuple(prompt[start:depth])  # a str slice hashes as is, in C
            digest = hash((digest, text, part))  # the prefix's hash, built on the one before
            start = depth
            levels[level][i] = digest
    counts = [Counter(k for k in keys if k is not None) for keys in levels]
    most = min(max_group_rows, int(MAX_GROUP_SHARE * len(prompts)))
    labels: list[int | None] = [None] * len(prompts)
    for i in range(len(prompts)):
        for level, keys in enumerate(levels):
            key = keys[i]
            if key is None:
                break
            shared = counts[level][key]
            if shared <= most:
                labels[i] = hash((level, key)) if shared > 1 else None
                break
    return labels


def shares_prefixes(texts: Sequence[str]) -> bool:
    """Whether some of these prompt texts share a long prefix that makes a group (a document)."""
    return any(label is not None for label in prefix_labels(texts))


def grouped(requests: Sequence[Request], key: Key, *, depths: Sequence[int] = PREFIX_DEPTHS,
            max_group_rows: int = MAX_GROUP_ROWS) -> list[list[Request]]:
    """The window as groups, each sorted by `key` descending, groups by their first (largest) row's key.

    A row that shares no prefix is a group of its own, so a window without shared prefixes
    comes out in the order of sorted(requests, key=key, reverse=True), one row a group.
    """
    groups: dict[Any, list[Request]] = {}
    labels = prefix_labels([_compared(r) for r in requests], depths=depths, max_group_rows=max_group_rows)
    for i, (request, label) in enumerate(zip(requests, labels, strict=True)):
        groups.setdefault(("alone", i) if label is None else label, []).append(request)
    ordered = [sorted(group, key=key, reverse=True) for group in groups.values()]
    return sorted(ordered, key=lambda group: key(group[0]), reverse=True)


def _compared(request: Request) -> Sequence[Any]:
    """What a request's prefix is read from: its ids, or its text where it travels as text."""
    tokens = request.tokens
    return tokens.text if isinstance(tokens, PromptText) else tokens
