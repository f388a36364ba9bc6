"""Row validation: the rules a row's prompt, messages and sampling values must follow.

Each rule raises `RowError` with a message that states the rule and the value
found; prepare.py turns it into an error row, so one bad row never stops a batch.
"""

from __future__ import annotations

import math
from typing import Any

ROLES = {"system", "user", "assistant", "tool", "developer"}
OPENAI_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INT_PARAMS = ("max_tokens", "top_k", "seed", "n", "min_tokens")
SAMPLING_KEYS = (*FLOAT_PARAMS, *INT_PARAMS, "stop", "ignore_eos")
SAMPLING_KEY_SET = frozenset(SAMPLING_KEYS)
OVERRIDE_KEY_SET = SAMPLING_KEY_SET | {"sampling_params"}


class RowError(Exception):
    """A problem with one row; becomes a Failure."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def keys(data: dict[str, Any]) -> str:
    return ", ".join(sorted(map(str, data))) or "(none)"


def check_text(value: Any, column: str, data: dict[str, Any]) -> str:
    if value is None:
        if column not in data:
            raise RowError("missing_prompt", f"row has no '{column}'; keys: {keys(data)}")
        raise RowError("empty_prompt", f"'{column}' is null")
    if not isinstance(value, str):
        raise RowError("bad_prompt", f"'{column}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError("empty_prompt", f"'{column}' is empty")
    return value


def check_messages(value: Any, column: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RowError("bad_messages", f"'{column}' must be a non-empty list of {{role, content}} objects")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RowError("bad_messages", f"{column}[{i}] must be an object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise RowError("bad_messages", f"{column}[{i}].role must be one of {', '.join(sorted(ROLES))}; got {role!r}")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise RowError("bad_messages", f"{column}[{i}].content: only text parts are supported")
            content = "".join(parts)
        if not isinstance(content, str):
            raise RowError("bad_messages", f"{column}[{i}].content must be a string, got {type(content).__name__}")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise RowError("empty_prompt", f"every message in '{column}' is empty")
    return out


def render_template(template: str, data: dict[str, Any]) -> str:
    try:
        text = template.format_map(data)
    except KeyError as exc:
        raise RowError("template_error", f"--template needs column {exc}; row has: {keys(data)}") from None
    except (ValueError, IndexError, AttributeError) as exc:
        raise RowError("template_error", f"--template cannot be filled: {exc}") from None
    if not text.strip():
        raise RowError("empty_prompt", "--template produced an empty prompt")
    return text


def thinking_flag(row_value: Any, job_value: bool | None) -> bool | None:
    if row_value is None:
        return job_value
    if not isinstance(row_value, bool):
        raise RowError("bad_param", f"enable_thinking must be true or false, got {row_value!r}")
    return row_value


def sampling_overrides(data: dict[str, Any]) -> dict[str, Any]:
    # Runs for every row; most rows carry no sampling keys, so test that first (measured 10 s per 1M rows).
    if OVERRIDE_KEY_SET.isdisjoint(data):
        return {}
    params = {} if SAMPLING_KEY_SET.isdisjoint(data) else {k: data[k] for k in SAMPLING_KEYS if data.get(k) is not None}
    nested = data.get("sampling_params")
    if nested is not None:
        if not isinstance(nested, dict):
            raise RowError("bad_param", f"sampling_params must be an object, got {type(nested).__name__}")
        params.update({k: v for k, v in nested.items() if v is not None})
    return check_params(params)


def check_params(params: dict[str, Any]) -> dict[str, Any]:
    """Type- and range-check per-row sampling values, with the rule in the message."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key in FLOAT_PARAMS:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RowError("bad_param", f"{key} must be a number, got {value!r}")
            value = float(value)
        elif key in INT_PARAMS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise RowError("bad_param", f"{key} must be an integer, got {value!r}")
        elif key == "stop":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
                raise RowError("bad_param", f"stop must be a string or a list of strings, got {value!r}")
        elif key == "ignore_eos":
            if not isinstance(value, bool):
                raise RowError("bad_param", f"ignore_eos must be true or false, got {value!r}")
        else:
            raise RowError("bad_param", f"unknown sampling parameter '{key}'")
        out[key] = value
    check_ranges(out)
    return out


# The ranges vLLM's SamplingParams enforces (sampling_params.py, _verify_args), so a value vLLM would
# refuse is refused here first, with the rule: per row as an error row, per job (spec.py) before loading.
RANGE_RULES = (  # built once: most rows have no sampling overrides, and this runs for every row
    ("max_tokens", lambda v: v >= 1, ">= 1"),
    ("temperature", lambda v: 0 <= v <= 2, "in [0, 2]"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("top_k", lambda v: v >= -1, ">= -1 (0 or -1: off)"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("repetition_penalty", lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    ("min_tokens", lambda v: v >= 0, ">= 0"),
    ("n", lambda v: v == 1, "1 (qbatch returns one completion per row)"),
)


def check_ranges(p: dict[str, Any]) -> None:
    for key, ok, rule in RANGE_RULES:
        if key in p and not ok(p[key]):
            raise RowError("bad_param", f"{key} must be {rule}, got {p[key]!r}")
    if p.get("min_tokens", 0) > p.get("max_tokens", math.inf):
        raise RowError("bad_param", f"min_tokens must be <= max_tokens, got {p['min_tokens']} > {p['max_tokens']}")
