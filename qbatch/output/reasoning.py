"""The reasoning split: Qwen3-style `<think>...</think>` output into reasoning and text."""

from __future__ import annotations

from qbatch.records import THINK_CLOSE, THINK_OPEN


def split_reasoning(output: str, thinking: bool | None) -> tuple[str | None, str]:
    """(reasoning, text) split at the last `</think>`.

    `thinking` is None for models that do not think: all text, reasoning null.
    With thinking on and no `</think>`, the output was cut off inside the
    reasoning: all of it is reasoning and the answer is empty. With thinking
    off, a model may still emit an (empty) think block, which is removed.
    """
    if thinking is None:
        return None, output
    head, sep, tail = output.rpartition(THINK_CLOSE)
    if not sep:
        return (output.removeprefix(THINK_OPEN).strip(), "") if thinking else (None, output)
    reasoning = head.strip().removeprefix(THINK_OPEN).strip()
    return (reasoning if thinking or reasoning else None), tail.lstrip()
