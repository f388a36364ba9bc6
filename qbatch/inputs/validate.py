"""Row validation: the rules a row's prompt, messages and sampling values must follow.

Each rule raises `RowError` with a message that states the rule and the value
found; prepare.py turns it into an error row, so one bad row never stops a batch.
"""

from __future__ import annotations

from typing import Any

from qbatch.errors import RowError
from qbatch.sampling import FLOAT_PARAMS, GUIDED_COLUMNS, INT_PARAMS, SAMPLING_KEY_SET, SAMPLING_KEYS, check_params

ROLES = {"system", "user", "assistant", "tool", "developer"}
OPENAI_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}  # generation (`qbatch run`)
EMBEDDINGS_URL = "/v1/embeddings"  # `qbatch embed`
OVERRIDE_KEY_SET = SAMPLING_KEY_SET | {"sampling_params"} | GUIDED_COLUMNS.keys()
# An OpenAI request body's keys: those qbatch applies, by the url's kind, and those that change nothing
# here (the service's model answers whatever `model` says). Any other key fails its request unless it
# is null, false or empty: a setting the client asked for is never silently dropped. Sampling keys are
# OpenAI's, and vLLM's extensions its OpenAI server takes (top_k, min_p, ignore_eos, ...).
BODY_SAMPLING_KEYS = (*FLOAT_PARAMS, *INT_PARAMS, "stop", "logprobs", "logit_bias", "ignore_eos")
_GENERATION_KEYS = {*BODY_SAMPLING_KEYS, "max_completion_tokens", "response_format", "chat_template_kwargs"}
BODY_KEYS = {"chat": frozenset({"messages", *_GENERATION_KEYS}), "completion": frozenset({"prompt", *_GENERATION_KEYS}),
             "embedding": frozenset({"input", "dimensions", "encoding_format"})}
NEUTRAL_BODY_KEYS = frozenset({"model", "user", "metadata", "store", "service_tier", "safety_identifier",
                               "prompt_cache_key"})


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


def prompt_or_tokens(value: Any, name: str, data: dict[str, Any], *, vocab_size: int) -> str | list[int]:
    """OpenAI's `prompt` (completions) or `input` (embeddings): a string or a list of token ids, or a list
    holding one of them. qbatch takes one input a line (one custom_id, one result): a list of several is refused."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if not isinstance(value, list):
        return check_text(value, name, data)
    if not value:
        raise RowError("empty_prompt", f"'{name}' is empty")
    if all(type(token) is int for token in value):
        for index, token in enumerate(value):
            if not 0 <= token < vocab_size:
                raise RowError("bad_body", f"{name}[{index}] is {token}, not a token id of the model "
                                           f"(0 to {vocab_size - 1})")
        return value
    if all(isinstance(item, (str, list)) for item in value):
        raise RowError("bad_body", f"{name} holds {len(value)} inputs; qbatch takes one input a line (one custom_id "
                                   "a result): split them into lines of their own")
    raise RowError("bad_body", f"{name} must be a string, a list of token ids, or a list holding one of them")


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
            parts = [p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text"
                     and isinstance(p.get("text"), str)]
            if len(parts) != len(content):
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
    # Runs for every row; most rows carry no sampling keys, so test that first.
    if OVERRIDE_KEY_SET.isdisjoint(data):
        return {}
    params = {} if SAMPLING_KEY_SET.isdisjoint(data) else {k: data[k] for k in SAMPLING_KEYS if data.get(k) is not None}
    nested = data.get("sampling_params")
    if nested is not None:
        if not isinstance(nested, dict):
            raise RowError("bad_param", f"sampling_params must be an object, got {type(nested).__name__}")
        params.update({k: v for k, v in nested.items() if v is not None})
    guided = {GUIDED_COLUMNS[k]: data[k] for k in GUIDED_COLUMNS if data.get(k) is not None}
    if guided:
        if "structured_outputs" in params:
            raise RowError("bad_constraint", f"row has both structured_outputs and {', '.join(sorted(guided))}")
        params["structured_outputs"] = guided
    return check_params(params)


def response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's `response_format` as a structured_outputs constraint (None: free text)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise RowError("bad_constraint", "response_format json_schema needs json_schema.schema")
        return {"json": schema}
    raise RowError("bad_constraint", f"response_format.type must be text, json_object or json_schema, got {kind!r}")


def check_body_keys(body: dict[str, Any], kind: str) -> None:
    """Every key of an OpenAI request body is applied (BODY_KEYS), changes nothing (NEUTRAL_BODY_KEYS) or is
    unset; any other fails the request."""
    for key, value in body.items():
        if key in BODY_KEYS[kind] or key in NEUTRAL_BODY_KEYS or value is None or value is False or value in ([], {}):
            continue
        raise RowError("unsupported_parameter", f"body.{key} is not supported by qbatch; leave it out")
