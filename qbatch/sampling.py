"""The rules sampling values follow, the same for a job's settings and a row's overrides.

They are vLLM's own ranges (its SamplingParams._verify_args), so a value vLLM would refuse is
refused first, with the rule in the message: per row as an error row, per job (spec.py) before
anything loads.
"""

from __future__ import annotations

import math
from typing import Any

from qbatch.errors import RowError

FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INT_PARAMS = ("max_tokens", "top_k", "seed", "n", "min_tokens")
SAMPLING_KEYS = (*FLOAT_PARAMS, *INT_PARAMS, "stop", "ignore_eos")
SAMPLING_KEY_SET = frozenset(SAMPLING_KEYS)


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
