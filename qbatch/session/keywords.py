"""Errors in the words of a Python caller: the setting a CLI flag names, as the keyword argument that sets it.

Library errors name the flag that fixes them (`raise --max-tokens`, `pass --no-thinking`), as the CLI
prints them. A Session call passes the same settings as keyword arguments, so at its boundary each
flag of a setting becomes that keyword (`max_tokens=`, `thinking=False`, `engines_per_gpu=2`), in the
message, the place and the hint alike. Flags that are no setting (`--server`, `qbatch run --help`) stay.
"""

from __future__ import annotations

import contextlib
import re
import typing
from collections.abc import Iterator
from functools import lru_cache

from qbatch.errors import QbatchError

# A flag, then maybe its value: a number, a placeholder (N, NAME=PATH, I/N) or a word (`--backend ray`).
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)(?: (\w[\w./=-]*))?")
# Words that follow a flag in a sentence and are never its value (`raise --max-tokens or pass ...`).
PROSE = frozenset("or and if to with is must needs reads produced over column cannot it its that resumes limits seeds "
                  "says lists dropped meanwhile names job has starts where so the a an for of in on at as than then "
                  "when while per each was were be are not out up off".split())


@lru_cache(maxsize=1)
def _settings() -> dict[str, bool]:
    """Every setting a run takes, and whether it is a switch (a bool: `--x` / `--no-x`)."""
    from qbatch.spec import SECTIONS

    return {key: bool in typing.get_args(hint) or hint is bool
            for cls in SECTIONS.values() for key, hint in typing.get_type_hints(cls).items()}


def keyword(match: re.Match[str]) -> str:
    """One flag (and its value) as the keyword argument that sets it; the flag as it was for no setting."""
    flag, value = match.group(1), match.group(2)
    key, negated = flag.replace("-", "_"), False
    settings = _settings()
    if key not in settings and key.startswith("no_") and settings.get(key[3:]):
        key, negated = key[3:], True
    if key not in settings:
        return match.group(0)
    tail = ""
    if value is not None and (settings[key] or value in PROSE):  # a switch takes no value: the word is prose
        tail, value = f" {value}", None
    if settings[key]:
        return f"{key}={not negated}{tail}"
    if value is None:
        return f"{key}={tail}"
    if "=" in value and value.isupper():  # NAME=PATH: a dict setting's item
        name, _, item = value.partition("=")
        return f"{key}={{{name!r}: {item!r}}}"
    return f"{key}={value if value[0].isdigit() or value.isupper() else repr(value)}"


def for_python(text: str | None) -> str | None:
    """`text` with each flag of a setting worded as its keyword argument."""
    return None if text is None else FLAG.sub(keyword, text)


@contextlib.contextmanager
def keyword_errors() -> Iterator[None]:
    """qbatch errors raised inside, reworded for a Python caller (their message, place and hint)."""
    try:
        yield
    except QbatchError as exc:
        exc.message, exc.where, exc.hint = for_python(exc.message) or "", for_python(exc.where), for_python(exc.hint)
        exc.args = (exc.message, *exc.args[1:])
        raise
