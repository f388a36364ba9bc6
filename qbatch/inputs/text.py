"""Text that is not Unicode, and where a row holds it.

A JSON line may hold a lone surrogate escape ("\\ud800": valid JSON, half of a UTF-16 pair, no
character) or bytes that are not UTF-8 (read with `surrogateescape`, so that the line still
parses); a Parquet file written without checks may hold such bytes too. Neither the tokenizer
nor Arrow takes such a string, so the row that holds one fails alone, keeping its id when the
id itself is text. The messages name the place and escape the bad character: they are text.
"""

from __future__ import annotations

import re
from typing import Any

SURROGATE = re.compile("[\ud800-\udfff]")
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a lone surrogate gets into a UTF-8 JSON line


def is_text(value: str) -> bool:
    """Whether UTF-8 can encode the string: it holds no surrogate."""
    return value.isascii() or SURROGATE.search(value) is None


def escaped(value: str) -> str:
    """The string with its surrogates written as \\uXXXX escapes (printable, and encodable)."""
    return SURROGATE.sub(lambda match: f"\\u{ord(match.group()):04x}", value)


def find_bad_text(value: Any, where: str = "") -> tuple[str, str] | None:
    """(place, string) of the first string or key in a parsed row that is not text, or None.

    Places read as the row's columns do: 'prompt', 'messages[0].content', the key 'k' of 'meta'.
    """
    kind = type(value)
    if kind is str:
        return None if is_text(value) else (f"'{where}'", value)
    if kind is dict:
        for key, item in value.items():
            if type(key) is str and not is_text(key):
                return f"the key '{escaped(key)}' of {repr(where) if where else 'the row'}", key
            found = find_bad_text(item, f"{where}.{key}" if where else str(key))
            if found is not None:
                return found
    elif kind is list:
        for index, item in enumerate(value):
            found = find_bad_text(item, f"{where}[{index}]")
            if found is not None:
                return found
    return None


def lone_surrogate(data: dict[str, Any]) -> str | None:
    """Why a parsed line's row cannot be sent, when it holds a lone surrogate escape; None when it holds none
    (a valid pair, or an escaped backslash before "u")."""
    found = find_bad_text(data)
    if found is None:
        return None
    place, value = found
    match = SURROGATE.search(value)
    if match is None:  # not reached: find_bad_text found `value` by this pattern
        return None
    char = match.group()
    return (f"{place} holds the lone surrogate \\u{ord(char):04x} (half of a UTF-16 pair), which is not a "
            "character; fix the line's \\u escapes")


def not_utf8(data: dict[str, Any], offset: int) -> str:
    """Why a line's row cannot be sent when its bytes are not UTF-8 (`offset`: the first bad byte)."""
    found = find_bad_text(data)
    place = f", in {found[0]}" if found is not None else ""
    return f"line is not valid UTF-8 (byte offset {offset}{place}); save the file as UTF-8"


def column_not_utf8(name: str) -> str:
    """Why a Parquet row cannot be sent when a column's text is not UTF-8."""
    return f"column '{name}' is not valid UTF-8; save the file's text as UTF-8"
