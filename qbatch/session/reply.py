"""One prompt's answer on the quick paths, in-process (session.py) or on a service (remote.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reply:
    """One prompt's answer on the quick paths (`generate`, `chat`, the LangChain model)."""

    text: str | None
    reasoning: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None  # the error kind when the row failed; `message` says why
    message: str | None = None
