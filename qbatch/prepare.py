"""Prompt preparation: rows -> validated, templated, tokenized `Request`s.

Each row is interpreted by its shape (plain prompt, chat messages, OpenAI
Batch API line, or a `--template` over its columns), given its sampling
parameters, rendered through the chat template and tokenized in bulk with the
fast tokenizer (which uses every core). Anything wrong with a row becomes a
`Failure` with a message; one bad row never stops the batch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qbatch.errors import ModelError, SpecError
from qbatch.records import Failure, Request, Row
from qbatch.spec import JobSpec

ROLES = {"system", "user", "assistant", "tool", "developer"}
OPENAI_KEYS = {"custom_id", "method", "url", "body"}
OPENAI_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INT_PARAMS = ("max_tokens", "top_k", "seed", "n", "min_tokens")
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class RowError(Exception):
    """A problem with one row; becomes a Failure."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(slots=True)
class _Draft:
    """A row understood but not yet rendered or tokenized."""

    row: Row
    id: str
    messages: list[dict[str, Any]] | None  # None: `text` is sent as is
    text: str | None
    overrides: dict[str, Any]
    thinking: bool | None
    extra: dict[str, Any]


def load_tokenizer(path: str, revision: str | None = None) -> Any:
    """The model's fast tokenizer (no engine needed)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, revision=revision)
    except Exception as exc:  # hub/IO/format errors all mean "cannot load"
        raise ModelError(
            f"cannot load the tokenizer of model '{path}': {str(exc).splitlines()[0][:300]}",
            hint="pass a local model folder, or --model smollm2-135m (bundled, works offline)",
        ) from None


def generation_defaults(model_path: str) -> dict[str, Any]:
    """Sampling defaults from the model's generation_config.json, as vLLM would apply them."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {key: config[key] for key in GENERATION_CONFIG_KEYS if config.get(key) is not None}


def row_id(row: Row, id_column: str | None, positional_prefix: bool) -> str:
    """The row's id: its id column, else `id`, else OpenAI's `custom_id`, else its position."""
    if row.data is None:
        return fallback_id(row)
    data = row.data
    for column in (id_column,) if id_column else ("id", "custom_id"):
        value = data.get(column)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value) != "":
            return str(value)
        if id_column:
            raise RowError("missing_id", f"row has no usable '{id_column}' (set by --id-column); keys: {_keys(data)}")
    return f"{Path(row.source).name}:{row.row_index}" if positional_prefix else str(row.row_index)


def fallback_id(row: Row) -> str:
    """An id for a row whose own id is missing or unreadable: file name and position."""
    return f"{Path(row.source).name}#{row.row_index}"


def _failure(row: Row, rid: str, exc: RowError) -> Failure:
    return Failure(rid, row.source, row.row_index, row.line, exc.kind, exc.message)


def in_shard(rid: str, shard: tuple[int, int] | None) -> bool:
    """Stable assignment of ids to shards, independent of row order."""
    if shard is None:
        return True
    digest = hashlib.blake2b(rid.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shard[1] == shard[0]


class Preparer:
    """Turns windows of rows into requests; holds the tokenizer and job-level defaults."""

    def __init__(self, spec: JobSpec, tokenizer: Any, *, max_model_len: int, base_sampling: dict[str, Any],
                 positional_prefix: bool = False):
        self.spec = spec
        self.input = spec.input
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.base_sampling = base_sampling
        self.positional_prefix = positional_prefix
        self.model_thinks = "</think>" in tokenizer.get_vocab()
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        if not self.input.raw and not self.has_template and self.input.shape != "openai":
            raise SpecError(
                "the model has no chat template, so prompts cannot be sent as chat turns",
                hint="pass --raw to send prompt text as is",
            )

    def prepare(self, rows: list[tuple[Row, str]]) -> tuple[list[Request], list[Failure]]:
        """Requests and failures for a window of (row, id) pairs."""
        drafts: list[_Draft] = []
        failures: list[Failure] = []
        for row, rid in rows:
            try:
                drafts.append(self._draft(row, rid))
            except RowError as exc:
                failures.append(_failure(row, rid, exc))
        requests = self._tokenize(drafts, failures)
        return requests, failures

    def row_id(self, row: Row) -> str:
        """The row's id; rows whose id cannot be read get a stable one from their position."""
        try:
            return row_id(row, self.input.id_column, self.positional_prefix)
        except RowError:
            return fallback_id(row)

    # -- one row -----------------------------------------------------------
    def _draft(self, row: Row, rid: str) -> _Draft:
        if row.data is None:
            raise RowError("bad_line", row.error or "unreadable line")
        data = row.data
        if self.input.id_column:
            row_id(row, self.input.id_column, self.positional_prefix)  # raises missing_id
        shape = self._shape(data)
        if shape == "openai":
            return self._draft_openai(row, rid, data)
        overrides = _sampling_overrides(data)
        thinking = _thinking(data.get("enable_thinking"), self.input.thinking)
        if shape == "chat":
            messages = _check_messages(data.get(self.input.messages_column), self.input.messages_column)
            messages = self._with_system(messages)
            skip = {self.input.messages_column}
            return _Draft(row, rid, messages, None, overrides, thinking, self._extra(data, skip))
        if shape == "template":
            text = _render_template(self.input.template or "", data)
            skip: set[str] = set()
        else:
            text = _check_text(data.get(self.input.prompt_column), self.input.prompt_column, data)
            skip = {self.input.prompt_column}
        if self.input.raw:
            return _Draft(row, rid, None, text, overrides, thinking, self._extra(data, skip))
        messages = self._with_system([{"role": "user", "content": text}])
        return _Draft(row, rid, messages, None, overrides, thinking, self._extra(data, skip))

    def _draft_openai(self, row: Row, rid: str, data: dict[str, Any]) -> _Draft:
        url = data.get("url")
        body = data.get("body")
        if url not in OPENAI_URLS:
            raise RowError("unsupported_url", f"url must be one of {', '.join(OPENAI_URLS)}; got {url!r}")
        if not isinstance(body, dict):
            raise RowError("bad_body", f"'body' must be an object, got {type(body).__name__}")
        params = {k: body[k] for k in (*FLOAT_PARAMS, *INT_PARAMS, "stop") if k in body and body[k] is not None}
        if body.get("max_completion_tokens") is not None:
            params["max_tokens"] = body["max_completion_tokens"]
        overrides = _check_params(params)
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = _thinking(kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None, self.input.thinking)
        if OPENAI_URLS[url] == "completion":
            text = _check_text(body.get("prompt"), "body.prompt", body)
            return _Draft(row, rid, None, text, overrides, thinking, {})
        messages = self._with_system(_check_messages(body.get("messages"), "body.messages"))
        return _Draft(row, rid, messages, None, overrides, thinking, {})

    def _shape(self, data: dict[str, Any]) -> str:
        if self.input.template:
            return "template"
        if self.input.shape != "auto":
            return self.input.shape
        if "custom_id" in data and ("body" in data or "url" in data):
            return "openai"
        if self.input.messages_column in data and self.input.prompt_column not in data:
            return "chat"
        if self.input.prompt_column in data:
            return "prompt"
        raise RowError(
            "missing_prompt",
            f"row has no '{self.input.prompt_column}' or '{self.input.messages_column}' column; keys: {_keys(data)}. "
            "Use --prompt-column NAME or --template '...{column}...'",
        )

    def _with_system(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.input.system_prompt and not any(m["role"] == "system" for m in messages):
            return [{"role": "system", "content": self.input.system_prompt}, *messages]
        return messages

    def _extra(self, data: dict[str, Any], skip: set[str]) -> dict[str, Any]:
        keep = self.input.keep_columns
        if keep is not None:
            return {name: data.get(name) for name in keep}
        return {k: v for k, v in data.items() if k not in skip}

    # -- bulk render + tokenize -------------------------------------------
    def _tokenize(self, drafts: list[_Draft], failures: list[Failure]) -> list[Request]:
        texts: list[str | None] = [None] * len(drafts)
        templated = [i for i, d in enumerate(drafts) if d.messages is not None]
        for thinking in {drafts[i].thinking for i in templated}:
            group = [i for i in templated if drafts[i].thinking == thinking]
            for i, text in zip(group, self._render([drafts[i].messages for i in group], thinking), strict=True):
                texts[i] = text
        token_ids: list[list[int] | None] = [None] * len(drafts)
        for add_special, group in ((False, templated), (True, [i for i, d in enumerate(drafts) if d.messages is None])):
            batch = [texts[i] if texts[i] is not None else drafts[i].text for i in group]
            if batch:
                encoded = self.tokenizer(batch, add_special_tokens=add_special)["input_ids"]
                for i, ids, text in zip(group, encoded, batch, strict=True):
                    token_ids[i], texts[i] = ids, text
        requests = []
        for draft, ids, text in zip(drafts, token_ids, texts, strict=True):
            try:
                requests.append(self._request(draft, ids or [], text))
            except RowError as exc:
                failures.append(_failure(draft.row, draft.id, exc))
        return requests

    def _render(self, conversations: list[Any], thinking: bool | None) -> list[str]:
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        try:
            rendered = self.tokenizer.apply_chat_template(
                conversations, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception:  # one bad conversation fails the batch call: render one by one
            rendered = [self._render_one(c, kwargs) for c in conversations]
        return list(rendered)

    def _render_one(self, conversation: Any, kwargs: dict[str, Any]) -> str:
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as exc:
            return _RenderFailed(str(exc))

    def _request(self, draft: _Draft, ids: list[int], text: str | None) -> Request:
        if isinstance(text, _RenderFailed):
            raise RowError("template_error", f"the chat template rejected the messages: {text.reason}")
        num = len(ids)
        if num == 0:
            raise RowError("empty_prompt", "prompt is empty after tokenization")
        if num >= self.max_model_len:
            raise RowError(
                "prompt_too_long",
                f"prompt has {num} tokens but max_model_len is {self.max_model_len}, leaving no room for output; "
                "raise --max-model-len or shorten the prompt",
            )
        sampling = {**self.base_sampling, **draft.overrides}
        sampling["max_tokens"] = min(sampling["max_tokens"], self.max_model_len - num)
        thinking = None
        if self.model_thinks:
            thinking = True if draft.thinking is None else draft.thinking
        prompt = text if self.spec.output.include_prompt else None
        return Request(draft.id, draft.row.source_index, draft.row.row_index, ids, sampling, thinking,
                       draft.extra, prompt)



class _RenderFailed(str):
    """Marks a conversation the chat template refused, carrying the reason."""

    def __new__(cls, reason: str) -> _RenderFailed:
        obj = super().__new__(cls, "")
        obj.reason = reason
        return obj


def _keys(data: dict[str, Any]) -> str:
    return ", ".join(sorted(map(str, data))) or "(none)"


def _check_text(value: Any, column: str, data: dict[str, Any]) -> str:
    if value is None:
        if column not in data:
            raise RowError("missing_prompt", f"row has no '{column}'; keys: {_keys(data)}")
        raise RowError("empty_prompt", f"'{column}' is null")
    if not isinstance(value, str):
        raise RowError("bad_prompt", f"'{column}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError("empty_prompt", f"'{column}' is empty")
    return value


def _check_messages(value: Any, column: str) -> list[dict[str, Any]]:
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


def _render_template(template: str, data: dict[str, Any]) -> str:
    try:
        text = template.format_map(data)
    except KeyError as exc:
        raise RowError("template_error", f"--template needs column {exc}; row has: {_keys(data)}") from None
    except (ValueError, IndexError, AttributeError) as exc:
        raise RowError("template_error", f"--template cannot be filled: {exc}") from None
    if not text.strip():
        raise RowError("empty_prompt", "--template produced an empty prompt")
    return text


def _thinking(row_value: Any, job_value: bool | None) -> bool | None:
    if row_value is None:
        return job_value
    if not isinstance(row_value, bool):
        raise RowError("bad_param", f"enable_thinking must be true or false, got {row_value!r}")
    return row_value


def _sampling_overrides(data: dict[str, Any]) -> dict[str, Any]:
    params = {k: data[k] for k in (*FLOAT_PARAMS, *INT_PARAMS, "stop", "ignore_eos") if data.get(k) is not None}
    nested = data.get("sampling_params")
    if nested is not None:
        if not isinstance(nested, dict):
            raise RowError("bad_param", f"sampling_params must be an object, got {type(nested).__name__}")
        params.update({k: v for k, v in nested.items() if v is not None})
    return _check_params(params)


def _check_params(params: dict[str, Any]) -> dict[str, Any]:
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
    _check_ranges(out)
    return out


def _check_ranges(p: dict[str, Any]) -> None:
    rules = [
        ("max_tokens", lambda v: v >= 1, ">= 1"),
        ("temperature", lambda v: v >= 0, ">= 0"),
        ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("top_k", lambda v: v >= -1, ">= -1 (0 or -1: off)"),
        ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
        ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
        ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
        ("repetition_penalty", lambda v: v > 0, "> 0"),
        ("min_tokens", lambda v: v >= 0, ">= 0"),
        ("n", lambda v: v == 1, "1 (qbatch returns one completion per row)"),
    ]
    for key, ok, rule in rules:
        if key in p and not ok(p[key]):
            raise RowError("bad_param", f"{key} must be {rule}, got {p[key]!r}")
