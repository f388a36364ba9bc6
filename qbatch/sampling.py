"""The rules sampling values follow, the same for a job's settings and a row's overrides.

They are vLLM's own ranges (its SamplingParams._verify_args), so a value vLLM would refuse is
refused first, with the rule in the message: per row as an error row, per job (spec.py) before
anything loads.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from typing import Any

from qbatch.errors import RowError

FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INT_PARAMS = ("max_tokens", "top_k", "seed", "n", "min_tokens", "top_logprobs", "thinking_token_budget")
SAMPLING_KEYS = (*FLOAT_PARAMS, *INT_PARAMS, "stop", "ignore_eos", "logprobs", "logit_bias", "structured_outputs")
SAMPLING_KEY_SET = frozenset(SAMPLING_KEYS)
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs: a larger value is refused by the engine
MAX_LOGIT_BIAS = 100  # OpenAI's range for a logit_bias value, [-100, 100] (vLLM clamps to it)


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
        elif key in ("ignore_eos", "logprobs"):
            if not isinstance(value, bool):
                raise RowError("bad_param", f"{key} must be true or false, got {value!r}")
        elif key == "logit_bias":
            value = check_logit_bias(value)
        elif key == "structured_outputs":
            value = check_structured(value)
        else:
            raise RowError("bad_param", f"unknown sampling parameter '{key}'")
        out[key] = value
    check_ranges(out)
    return out


def check_logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's logit_bias (token id -> bias; a JSON object's keys are text) as vLLM's SamplingParams takes it.
    A token id past the model's vocabulary is vLLM's to refuse: it fails its row alone."""
    if not isinstance(value, dict):
        raise RowError("bad_param", f"logit_bias must be an object of token id -> bias, got {value!r}")
    out: dict[int, float] = {}
    for token, bias in value.items():
        token_id = int(token) if isinstance(token, str) and token.isascii() and token.isdigit() else token
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise RowError("bad_param", f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) <= MAX_LOGIT_BIAS:
            raise RowError("bad_param", f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                                        f"got {bias!r} for token {token!r}")
        out[token_id] = float(bias)
    return out


# The ranges vLLM's SamplingParams enforces (sampling_params.py, _verify_args), so a value vLLM would
# refuse is refused here first, with the rule: per row as an error row, per job (spec.py) before loading.
RANGE_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (  # built once: most rows have no sampling overrides, and this runs for every row
    ("max_tokens", lambda v: v >= 1, ">= 1"),
    ("temperature", lambda v: 0 <= v <= 2, "in [0, 2]"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("top_k", lambda v: v >= -1, ">= -1 (0 or -1: off)"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("repetition_penalty", lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    ("min_tokens", lambda v: v >= 0, ">= 0"),
    ("n", lambda v: v >= 1, ">= 1"),
    ("top_logprobs", lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}] (vLLM's max_logprobs)"),
    ("thinking_token_budget", lambda v: v >= -1, ">= 0, or -1 for unlimited"),
    ("seed", lambda v: -1 <= v < 2**63, "in [0, 2**63) (vLLM keeps it as int64; -1: none)"),
)


# Derived seeds stay below 2**62: vLLM gives sample i of a request seed + i (v1 ParentRequest) and keeps
# seeds as int64, so seed + n never overflows.
ROW_SEED_BITS = 62


def row_seed(job_seed: int, row_id: str) -> int:
    """A row's seed under a job seed: a hash of both, so that reruns repeat each row's samples while rows
    (even with the same prompt) and jobs with other seeds differ. One job seed for every row would
    give every row with the same prompt the same output."""
    import hashlib

    digest = hashlib.blake2b(f"{job_seed}\0{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - ROW_SEED_BITS)


def check_ranges(p: dict[str, Any]) -> None:
    for key, ok, rule in RANGE_RULES:
        if key in p and not ok(p[key]):
            raise RowError("bad_param", f"{key} must be {rule}, got {p[key]!r}")
    if p.get("min_tokens", 0) > p.get("max_tokens", math.inf):
        raise RowError("bad_param", f"min_tokens must be <= max_tokens, got {p['min_tokens']} > {p['max_tokens']}")


# -- structured outputs: vLLM's StructuredOutputsParams, one constraint a request -------------------
CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's names
# Plain rows may use the names of vLLM's older guided decoding API (guided_json, ...): same constraints.
GUIDED_COLUMNS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def check_structured(value: Any) -> dict[str, Any]:
    """One structured-output constraint as vLLM's StructuredOutputsParams kwargs, checked here so that
    a bad schema or regex fails its row (or the job, spec.py) with the reason, never inside the engine."""
    if not isinstance(value, dict):
        raise RowError("bad_constraint", f"structured_outputs must be an object, got {type(value).__name__}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(CONSTRAINT_KEYS))
    if unknown:
        raise RowError("bad_constraint", f"unknown structured_outputs key '{unknown[0]}' "
                                         f"(one of {', '.join(CONSTRAINT_KEYS)})")
    if len(given) != 1:
        raise RowError("bad_constraint", f"structured_outputs needs exactly one of {', '.join(CONSTRAINT_KEYS)}, "
                                         f"got {len(given)}")
    (key, constraint), = given.items()
    if key == "json":
        return {"json": check_json_schema(constraint)}
    if key == "regex":
        return {"regex": check_regex(constraint)}
    if key == "choice":
        return {"choice": check_choice(constraint)}
    if key == "grammar":
        if not isinstance(constraint, str) or not constraint.strip():
            raise RowError("bad_constraint", "grammar must be a non-empty EBNF/Lark text")
        return {"grammar": constraint}
    if constraint is not True:
        raise RowError("bad_constraint", f"json_object must be true, got {constraint!r}")
    return {"json_object": True}


def check_json_schema(schema: Any) -> dict[str, Any]:
    """A JSON schema (object, or its JSON text) that is itself valid (Draft 2020-12's meta-schema)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise RowError("bad_constraint", f"JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise RowError("bad_constraint", f"JSON schema must be an object, got {type(schema).__name__}")
    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as exc:  # a schema built in Python holding a value JSON has not
        raise RowError("bad_constraint", f"JSON schema is not JSON: {exc}") from None
    error = _schema_error(text)
    if error is not None:
        raise RowError("bad_constraint", error)
    return schema


# Rows of a job nearly always share one schema, and checking it against the meta-schema costs
# milliseconds of Python (the GIL the engine loop needs): each distinct schema is checked once.
@functools.lru_cache(maxsize=1024)
def _schema_error(text: str) -> str | None:
    """Why the schema (its canonical JSON text) is not a valid JSON schema; None when it is."""
    try:
        import jsonschema
    except ImportError:  # vLLM's engine checks it (its error becomes the row's)
        return None
    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(map(str, exc.path)) or "(top)"
        return f"invalid JSON schema at {where}: {exc.message}"
    return None


def check_regex(pattern: Any) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise RowError("bad_constraint", f"regex must be a non-empty string, got {pattern!r}")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise RowError("bad_constraint", f"invalid regex {pattern!r}: {exc}") from None
    return pattern


def check_choice(choices: Any) -> list[str]:
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise RowError("bad_constraint", f"choice must be a non-empty list of non-empty strings, got {choices!r}")
    if len(set(choices)) != len(choices):
        raise RowError("bad_constraint", f"choice lists a value twice: {choices!r}")
    return choices


def to_vllm(params: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams kwargs from qbatch's (OpenAI's) names: `logprobs` (bool) and `top_logprobs` (int)
    become vLLM's `logprobs` (the number of alternatives a token; 0: the sampled token's only)."""
    if "logprobs" not in params and "top_logprobs" not in params:
        return params
    out = dict(params)
    wanted, top = out.pop("logprobs", False), out.pop("top_logprobs", None)
    if wanted or top is not None:
        out["logprobs"] = top or 0
    return out
