"""What a user must not miss in a result row: the `flag` column's values, and how they are counted and said.

A row's `flag` is null when its answer is usable as it is. Otherwise it names the one problem that
matters most, in this order:
- `in_reasoning`: the output ended inside the reasoning (a thinking row cut before `</think>`): no answer;
- `not_parsed`: a constrained row whose answer does not parse or match its constraint (`parse_error` says why);
- `empty`: the answer is empty;
- `cut`: the answer was cut at max_tokens (finish_reason `length`): there is one, but it is incomplete.

The first three are *unusable* (no answer a program can take); `cut` is counted and shown but still
carries text. `--max-unusable` fails a run whose share of unusable rows is above its value.
"""

from __future__ import annotations

IN_REASONING, NOT_PARSED, EMPTY, CUT = "in_reasoning", "not_parsed", "empty", "cut"
FLAGS = (IN_REASONING, NOT_PARSED, EMPTY, CUT)  # in the order of what matters most
UNUSABLE = frozenset({IN_REASONING, NOT_PARSED, EMPTY})

# What each flag means and how to fix it, as the summary, `qbatch status` and the report say it
_SAID = {
    IN_REASONING: ("ended inside their reasoning (no answer)", "raise --max-tokens or pass --no-thinking"),
    NOT_PARSED: ("did not parse under their constraint", "see parse_error; raise --max-tokens if they were cut"),
    EMPTY: ("gave an empty answer", "check the prompt and the chat template (--raw, --template)"),
    CUT: ("were cut at max_tokens (finish_reason length)", "raise --max-tokens if the answers must be whole"),
}


def row_flag(*, thinking: bool | None, answer: str, reasoning_closed: bool, finish_reason: str | None,
             parse_error: str | None) -> str | None:
    """A result row's flag (None: usable). `reasoning_closed`: whether a thinking row's output closed its
    reasoning; `parse_error`: the row's parse error under its constraint (None: none, or no constraint)."""
    if thinking and not reasoning_closed:
        return IN_REASONING
    if parse_error is not None:
        return NOT_PARSED
    if not answer.strip():
        return EMPTY
    if finish_reason == "length":
        return CUT
    return None


def unusable(flags: dict[str, int]) -> int:
    """Rows with no usable answer among counts by flag."""
    return sum(n for flag, n in flags.items() if flag in UNUSABLE)


def flag_lines(flags: dict[str, int], rows: int) -> list[str]:
    """One line a flag that rows have, with its fix: "29 of 40 rows ended inside their reasoning (no answer):
    raise --max-tokens or pass --no-thinking". `rows`: the result rows the counts are of."""
    lines = []
    for flag in FLAGS:
        if flags.get(flag):
            what, fix = _SAID[flag]
            lines.append(f"{flags[flag]:,} of {rows:,} rows {what}: {fix}")
    return lines
