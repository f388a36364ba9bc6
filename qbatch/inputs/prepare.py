"""Prompt preparation: rows -> validated, templated, tokenized `Request`s.

Each row is interpreted by its shape (plain prompt, chat messages, OpenAI
Batch API line, or a `--template` over its columns), given its sampling
parameters, rendered through the chat template and tokenized in bulk with the
fast tokenizer (which uses every core). Anything wrong with a row becomes a
`Failure` with a message; one bad row never stops the batch.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qbatch.errors import ModelError, RowError, SpecError, first_line
from qbatch.records import EMBED_SAMPLING, THINK_CLOSE, THINK_OPEN, Failure, PromptText, Request, Row
from qbatch.inputs.adapters import ADAPTER_COLUMN_SET, AdapterChoice
from qbatch.inputs.length import encode_within
from qbatch.inputs.row_kinds import BATCH_URLS, fallback_id, is_openai, own_id, positional_id, row_shape
from qbatch.inputs.splice import ChatSplicer
from qbatch.inputs.text import escaped
from qbatch.spec import JobSpec
from qbatch.tokens import TextEncoder, ids_of
from qbatch.inputs.validate import (
    BODY_SAMPLING_KEYS, EMBEDDINGS_URL, OPENAI_URLS, check_body_keys, check_messages, check_text, prompt_or_tokens,
    render_template, response_format, sampling_overrides, thinking_flag,
)
from qbatch.sampling import check_params, row_seed, to_vllm

GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# The body key an OpenAI batch line's input is in, by url: carried under that name (Preparer._openai_extra)
OPENAI_INPUT_KEYS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", EMBEDDINGS_URL: "input"}
Encoded = Any  # a prompt's token ids: a list of ints, or a tokenizers.Encoding (`len()`, `.ids`)


@dataclass(slots=True)
class Draft:
    """A row understood but not yet rendered or tokenized."""

    row: Row
    id: str
    messages: list[dict[str, Any]] | None  # None: `text` is sent as is
    text: str | None  # for chats: the rendered prompt, once rendered
    overrides: dict[str, Any]
    thinking: bool | None
    extra: dict[str, Any]
    ids: list[int] | None = None  # token ids the row gives (OpenAI's token-array prompt or input): not encoded
    adapter: str | None = None  # the LoRA adapter the row names (None: the base model)



def _rendered(draft: Draft) -> str:
    """A draft's text to encode: a chat's is rendered first (Preparer.render)."""
    if draft.text is None:
        raise ValueError(f"row {draft.id}: encoded before its prompt was rendered")
    return draft.text


def generation_defaults(model_path: str) -> dict[str, Any]:
    """Sampling defaults from the model's generation_config.json, as vLLM would apply them."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {key: config[key] for key in GENERATION_CONFIG_KEYS if config.get(key) is not None}


def _chat_template(tokenizer: Any) -> str | None:
    """The template `apply_chat_template` uses when given no tools, or None if there is no single one."""
    try:
        template: str | None = tokenizer.get_chat_template()
    except (ValueError, AttributeError):
        return None
    return template


def _adds_special_tokens(draft: Draft) -> bool:
    """Whether the tokenizer adds its special tokens to a draft's text: not to a chat-templated prompt, whose
    template wrote its own; to any other text (as vLLM's /v1/completions does)."""
    return draft.messages is None


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
                 positional_prefix: bool = False, unusable_adapters: dict[str, str] | None = None):
        """`unusable_adapters`: the job's LoRA adapters left out of the engines, each with what is wrong (the
        rows naming one fail: inputs/adapters.py)."""
        self.spec = spec
        self.input = spec.input
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.base_sampling = base_sampling
        self.positional_prefix = positional_prefix
        self.embeds = spec.engine.task == "embed"  # text in, vectors out: no chat template, no output tokens
        vocab = tokenizer.get_vocab()  # a dict of the whole vocabulary, built anew by each call: read once
        self._think_ids = (vocab.get(THINK_OPEN), vocab.get(THINK_CLOSE))
        self.model_thinks = self._think_ids[1] is not None and not self.embeds
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.splicer = ChatSplicer(_chat_template(tokenizer) if self.has_template else None, self._apply_template)
        self.encoder = TextEncoder(tokenizer)
        self.adapters = (AdapterChoice(spec.engine.lora or {}, spec.engine.model, unusable_adapters)
                         if spec.engine.lora or unusable_adapters else None)
        if not self.input.raw and not self.has_template and self.input.shape != "openai" and not self.embeds:
            raise SpecError(
                "the model has no chat template, so prompts cannot be sent as chat turns",
                hint="pass --raw to send prompt text as is",
            )

    def prepare(self, rows: list[tuple[Row, str]]) -> tuple[list[Request], list[Failure]]:
        """Requests and failures for a window of (row, id) pairs."""
        drafts, failures = self.render(rows)
        requests, more = self.requests(drafts, self.encode(drafts))
        return requests, failures + more

    def row_id(self, row: Row) -> str:
        """The row's id; a row whose id cannot be read (it becomes an error row) gets `fallback_id`,
        never a bare position that another row's real id could equal."""
        if row.data is None:
            return fallback_id(row)
        try:
            rid = own_id(row.data, self.input)
        except RowError:
            return fallback_id(row)
        if rid is None:
            return fallback_id(row) if is_openai(row.data, self.input) else positional_id(row, self.positional_prefix)
        return rid

    # -- one row -----------------------------------------------------------
    def _draft(self, row: Row, rid: str) -> Draft:
        if row.data is None:
            raise RowError("bad_line", row.error or "unreadable line")
        data = row.data
        if row.bad_text is not None:  # the id is kept when it is text: an error under its key
            raise RowError("bad_text" if self._has_id(data) else "missing_id", row.bad_text)
        own_id(data, self.input)  # raises missing_id: an id column without a usable value
        shape = row_shape(data, self.input)
        if self.embeds:
            return self._draft_embed(row, rid, data, shape)
        adapter = self.adapters.of(data, shape == "openai") if self.adapters else None
        draft = self._draft_openai(row, rid, data) if shape == "openai" else self._draft_text(row, rid, data, shape)
        draft.adapter = adapter
        return draft

    def _draft_text(self, row: Row, rid: str, data: dict[str, Any], shape: str) -> Draft:
        """A row of text, chat messages or a --template's columns."""
        overrides = sampling_overrides(data)
        thinking = thinking_flag(data.get("enable_thinking"), self.input.thinking)
        if shape == "chat":
            messages = check_messages(data.get(self.input.messages_column), self.input.messages_column)
            messages = self._with_system(messages)
            return Draft(row, rid, messages, None, overrides, thinking, self._extra(data))
        if shape == "template":
            text = render_template(self.input.template or "", data)
        else:
            text = check_text(data.get(self.input.prompt_column), self.input.prompt_column, data)
        if self.input.raw:
            return Draft(row, rid, None, text, overrides, thinking, self._extra(data))
        messages = self._with_system([{"role": "user", "content": text}])
        return Draft(row, rid, messages, None, overrides, thinking, self._extra(data))

    def _has_id(self, data: dict[str, Any]) -> bool:
        """Whether the row's id is its own or its position (not a stand-in: a batch line needs its custom_id)."""
        try:
            rid = own_id(data, self.input)
        except RowError:
            return False
        return rid is not None or not is_openai(data, self.input)

    def _draft_embed(self, row: Row, rid: str, data: dict[str, Any], shape: str) -> Draft:
        """An embedding row: its text as is (no chat template), the query instruction in front of it."""
        if shape == "openai":
            text = self._openai_input(row, data)
            extra = self._openai_extra(data)
            if not isinstance(text, str):
                if self.spec.embed.instruction:
                    raise RowError("bad_body", "body.input holds token ids; --instruction goes before text: "
                                               "give the input as text")
                return Draft(row, rid, None, None, {}, None, extra, text)
        elif shape == "chat":
            raise RowError("unsupported_shape", f"'{self.input.messages_column}' holds chat messages; an embedding "
                                                f"takes text: a '{self.input.prompt_column}' column (--prompt-column), "
                                                "--template or OpenAI /v1/embeddings lines")
        elif shape == "template":
            text = render_template(self.input.template or "", data)
            extra = self._extra(data)
        else:
            text = check_text(data.get(self.input.prompt_column), self.input.prompt_column, data)
            extra = self._extra(data)
        instruction = self.spec.embed.instruction
        if instruction:  # Qwen3-Embedding's query format (its model card); documents go without one
            text = f"Instruct: {instruction}\nQuery:{text}"
        return Draft(row, rid, None, text, {}, None, extra)

    def _openai_input(self, row: Row, data: dict[str, Any]) -> str | list[int]:
        """The input of an OpenAI /v1/embeddings batch line: one text, or one list of token ids, a line."""
        body = self._openai_body(row, data, urls=(EMBEDDINGS_URL,))
        check_body_keys(body, "embedding")
        dimensions = body.get("dimensions")
        if dimensions is not None and dimensions != self.spec.embed.dimensions:
            raise RowError("bad_body", f"body.dimensions is {dimensions!r} but the job's --dimensions is "
                                       f"{self.spec.embed.dimensions}; every vector of a job has one size")
        if body.get("encoding_format") not in (None, "float"):
            raise RowError("bad_body", f"body.encoding_format {body['encoding_format']!r} is not supported; "
                                       "leave it out or use 'float'")
        return prompt_or_tokens(body.get("input"), "body.input", body, vocab_size=self._vocab_size)

    def _openai_body(self, row: Row, data: dict[str, Any], *, urls: Any) -> dict[str, Any]:
        """A batch line's body, once its custom_id and url are checked against the urls this job takes."""
        if data.get("custom_id") is None:
            where = f"line {row.line}" if row.line is not None else f"row {row.row_index}"
            raise RowError("missing_id", f"OpenAI batch request has no 'custom_id' ({where}); every request needs "
                                         "its own, to match its result")
        url = data.get("url")
        body = data.get("body")
        if url not in urls:
            other = "`qbatch run`" if url in OPENAI_URLS else "`qbatch embed`" if url == EMBEDDINGS_URL else None
            needs = f" ({url} lines need {other})" if other else ""
            raise RowError("unsupported_url", f"url must be one of {', '.join(urls)}; got {url!r}{needs}")
        if not isinstance(body, dict):
            raise RowError("bad_body", f"'body' must be an object, got {type(body).__name__}")
        return body

    def _draft_openai(self, row: Row, rid: str, data: dict[str, Any]) -> Draft:
        body = self._openai_body(row, data, urls=tuple(OPENAI_URLS))
        url = data["url"]
        check_body_keys(body, OPENAI_URLS[url])
        params = {k: body[k] for k in BODY_SAMPLING_KEYS if k in body and body[k] is not None}
        if body.get("max_completion_tokens") is not None:
            params["max_tokens"] = body["max_completion_tokens"]
        constraint = response_format(body.get("response_format"))
        if constraint is not None:
            params["structured_outputs"] = constraint
        overrides = check_params(params)
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = thinking_flag(kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None, self.input.thinking)
        if OPENAI_URLS[url] == "completion":
            prompt = prompt_or_tokens(body.get("prompt"), "body.prompt", body, vocab_size=self._vocab_size)
            if isinstance(prompt, list):
                return Draft(row, rid, None, None, overrides, thinking, self._openai_extra(data), prompt)
            return Draft(row, rid, None, prompt, overrides, thinking, self._openai_extra(data))
        messages = self._with_system(check_messages(body.get("messages"), "body.messages"))
        return Draft(row, rid, messages, None, overrides, thinking, self._openai_extra(data))

    def _with_system(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.input.system_prompt and not any(m["role"] == "system" for m in messages):
            return [{"role": "system", "content": self.input.system_prompt}, *messages]
        return messages

    def carried(self, row: Row) -> tuple[dict[str, Any], bool]:
        """The columns a row carries to the results, as `_draft` keeps them, and whether the row fails
        there (for the pre-scan's type decision: output/columns.py lets failing rows' odd values, a number
        for a prompt, decide no column that passing rows give values)."""
        try:
            return self._draft(row, "").extra, False
        except RowError:
            pass
        data = row.data
        if data is None or row.bad_text is not None:
            return {}, True  # the row fails: it carries nothing
        try:
            shape = row_shape(data, self.input)
        except RowError:
            return {}, True
        return (self._openai_extra(data) if shape == "openai" else self._extra(data)), True

    def _extra(self, data: dict[str, Any]) -> dict[str, Any]:
        """The columns carried to the results: every input column, the prompt's or messages' included (a
        result shows its question), or --keep-columns, less --drop-columns."""
        keep, drop = self.input.keep_columns, self.input.drop_columns
        if self.adapters and not ADAPTER_COLUMN_SET.isdisjoint(data):  # the results' own `adapter` column says it
            data = {name: value for name, value in data.items() if name not in ADAPTER_COLUMN_SET}
        if keep is not None:
            return {name: data.get(name) for name in keep}
        if drop:
            return {name: value for name, value in data.items() if name not in drop}
        return data  # rows are read once and never changed: no copy for every row

    def _openai_extra(self, data: dict[str, Any]) -> dict[str, Any]:
        """What an OpenAI batch line carries: its body's input under the body's own name (`messages`,
        `prompt` or `input`) and its url (which names the response's object). Not the whole body: its
        other keys are the request's settings, which the job and the result columns already show, and
        a file's bodies seldom share one type (schemas, stop lists), so it would be JSON text."""
        url = data.get("url")
        if url not in OPENAI_INPUT_KEYS:
            return {}
        body = data.get("body")
        key = OPENAI_INPUT_KEYS[url]
        return {**self._extra({key: body.get(key) if isinstance(body, dict) else None}), "url": url}

    # -- bulk render + tokenize -------------------------------------------
    def render(self, rows: list[tuple[Row, str]]) -> tuple[list[Draft], list[Failure]]:
        """Drafts whose `text` is the prompt to encode (chats rendered), and the rows that failed.

        This is the window's Python work; `encode` is mostly the tokenizer's own threads, so a
        pipeline can render one window while the previous one is encoded (Job.windows).
        """
        drafts: list[Draft] = []
        failures: list[Failure] = []
        for row, rid in rows:
            try:
                drafts.append(self._draft(row, rid))
            except RowError as exc:
                failures.append(_failure(row, rid, exc))
        groups: dict[bool | None, list[Draft]] = {}
        for draft in drafts:
            if draft.messages is not None:
                draft.text = self.splicer.render(draft.messages, draft.thinking)
                if draft.text is None:
                    groups.setdefault(draft.thinking, []).append(draft)
        refused: set[int] = set()
        for thinking, group in groups.items():
            for draft, text in zip(group, self._render([d.messages for d in group], thinking), strict=True):
                if isinstance(text, RowError):
                    failures.append(_failure(draft.row, draft.id, text))
                    refused.add(id(draft))
                else:
                    draft.text = text
        return ([d for d in drafts if id(d) not in refused] if refused else drafts), failures

    def encode(self, drafts: list[Draft]) -> list[Encoded | RowError]:
        """Encodings of rendered drafts, in at most two batch calls (chat templates carry their own special tokens).

        They are the fast tokenizer's own objects where it is used: `requests` reads their counts, and
        their ids only where it needs them (a prompt from text travels as its text). A draft with its own
        token ids keeps them; a text the tokenizer refuses gets a RowError in its place.
        """
        kinds = [None if d.ids is not None else _adds_special_tokens(d) for d in drafts]  # None: ids given
        if len(set(kinds)) == 1 and kinds[0] is not None:  # one batch call: the usual window
            return self._encode([_rendered(d) for d in drafts], add_special_tokens=kinds[0])
        encoded: list[Encoded | RowError] = [d.ids for d in drafts]
        for special in (False, True):
            group = [i for i, kind in enumerate(kinds) if kind is special]
            if group:
                texts = [_rendered(drafts[i]) for i in group]
                for i, item in zip(group, self._encode(texts, add_special_tokens=special), strict=True):
                    encoded[i] = item
        return encoded

    def requests(self, drafts: list[Draft], encoded: list[Encoded | RowError]) -> tuple[list[Request], list[Failure]]:
        """Requests for encoded drafts, and the rows whose prompts cannot be sent (empty, too long, not encoded)."""
        requests, failures = [], []
        for draft, item in zip(drafts, encoded, strict=True):
            try:
                if isinstance(item, RowError):
                    raise item
                requests.append(self._request(draft, item))
            except RowError as exc:
                failures.append(_failure(draft.row, draft.id, exc))
        return requests, failures

    def _encode(self, texts: list[str], *, add_special_tokens: bool) -> list[Encoded | RowError]:
        """Encodings of texts; a text too long by its length alone is refused untokenized (inputs/length.py)."""
        encode = functools.partial(self._encode_all, add_special_tokens=add_special_tokens)
        limit = None if self.embeds and self.spec.embed.truncate else self.max_model_len  # --truncate: no limit
        return encode_within(texts, encode, self.tokenizer, limit, embeds=self.embeds)

    def _encode_all(self, texts: list[str], *, add_special_tokens: bool) -> list[Encoded | RowError]:
        try:
            return self.encoder.encode(texts, add_special_tokens=add_special_tokens)
        except Exception:  # one text the tokenizer refuses fails the whole call: encode one by one
            return [self._encode_one(text, add_special_tokens) for text in texts]

    def _encode_one(self, text: str, add_special_tokens: bool) -> Encoded | RowError:
        try:
            return self.encoder.encode([text], add_special_tokens=add_special_tokens)[0]
        except Exception as exc:  # the tokenizer's errors have no one type (TypeError for text that is not Unicode)
            return RowError("bad_text", f"the tokenizer cannot encode the prompt: {escaped(first_line(exc))}")

    def _render(self, conversations: list[Any], thinking: bool | None) -> list[str | RowError]:
        """Jinja renders of conversations (one list or several): the template's own output."""
        try:
            return list(self._apply_template(conversations, thinking))
        except Exception:  # one bad conversation fails the whole call: render one by one
            return [self._render_one(c, thinking) for c in conversations]

    def _render_one(self, conversation: Any, thinking: bool | None) -> str | RowError:
        try:
            rendered: str = self._apply_template(conversation, thinking)
            return rendered
        except Exception as exc:  # templates raise anything (jinja errors, raise_exception(...))
            return RowError("template_error", f"the chat template rejected the messages: {exc}")

    def _apply_template(self, conversations: Any, thinking: bool | None) -> Any:
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        return self.tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True, **kwargs)

    def _request(self, draft: Draft, encoded: Encoded) -> Request:
        """The row's request. A prompt from text travels as its text (PromptText): its ids are made a list
        only where the driver reads them (an embedding's truncation, a raw constrained row's last think token)."""
        num = len(encoded)
        if num == 0:
            raise RowError("empty_prompt", "prompt is empty after tokenization")
        if self.embeds:
            return self._embed_request(draft, ids_of(encoded))
        if num >= self.max_model_len:
            raise RowError(
                "prompt_too_long",
                f"prompt has {num} tokens but max_model_len is {self.max_model_len}, leaving no room for output; "
                "raise --max-model-len or shorten the prompt",
            )
        sampling = to_vllm({**self.base_sampling, **draft.overrides})
        if self.spec.engine.seed is not None and "seed" not in sampling:  # a row's own seed is kept as given
            sampling["seed"] = row_seed(self.spec.engine.seed, draft.id)
        sampling["max_tokens"] = min(sampling["max_tokens"], self.max_model_len - num)
        thinking = self._thinks(draft, sampling, encoded)
        prompt = draft.text if self.spec.output.include_prompt else None
        tokens = encoded if isinstance(encoded, list) else PromptText(_rendered(draft), _adds_special_tokens(draft), num)
        return Request(draft.id, draft.row.source_index, draft.row.row_index, tokens, sampling, thinking,
                       draft.extra, prompt, draft.adapter)

    def _thinks(self, draft: Draft, sampling: dict[str, Any], encoded: Encoded) -> bool | None:
        """Whether a row thinks: its output is split into reasoning and text (None: no split, the text as
        vLLM gives it). The rules, and why:
        - only a chat-templated row of a thinking model thinks: the template opens the reasoning (or closes
          it, thinking off). A raw prompt or an OpenAI /v1/completions line opens none, and vLLM's own
          /v1/completions splits nothing;
        - a constrained row thinks only where the engine has a reasoning parser: without one the constraint
          holds from the first token, so the output is all answer;
        - a raw constrained row under a reasoning parser is refused unless its prompt already closed the
          reasoning: the parser holds the constraint until `</think>`, which such a prompt never opens, so the
          constraint would silently never apply."""
        constrained = "structured_outputs" in sampling
        if draft.messages is None:
            if constrained and self.spec.engine.reasoning_parser and not self._closes_reasoning(ids_of(encoded)):
                raise RowError("constraint_not_applied", f"the row's prompt is sent as is (not through the chat "
                               f"template) and opens no reasoning, so the engine's reasoning parser "
                               f"({self.spec.engine.reasoning_parser}) would hold its constraint until a "
                               "`</think>` the model never writes: the constraint would not apply")
            return None
        if not self.model_thinks or (constrained and not self.spec.engine.reasoning_parser):
            return None
        return True if draft.thinking is None else draft.thinking

    def _closes_reasoning(self, ids: list[int]) -> bool:
        """Whether a prompt's last think token closes the reasoning (vLLM's parsers then constrain from the start)."""
        open_id, close_id = self._think_ids
        for token in reversed(ids):
            if token == close_id:
                return True
            if token == open_id:
                return False
        return False

    def _embed_request(self, draft: Draft, ids: list[int]) -> Request:
        """An embedding request: the whole input fits max_model_len (vLLM's pooling runner takes a prompt
        of max_model_len tokens, no room for output needed), or with --truncate its first tokens do."""
        if len(ids) > self.max_model_len:
            if not self.spec.embed.truncate:
                raise RowError("prompt_too_long", f"input has {len(ids)} tokens but max_model_len is "
                                                  f"{self.max_model_len}; pass --truncate to embed its first "
                                                  f"{self.max_model_len} tokens, or raise --max-model-len")
            ids = self._truncated(ids)
        prompt = draft.text if self.spec.output.include_prompt else None
        return Request(draft.id, draft.row.source_index, draft.row.row_index, ids, dict(EMBED_SAMPLING), None,
                       draft.extra, prompt)

    def _truncated(self, ids: list[int]) -> list[int]:
        """The first max_model_len tokens, keeping the special tokens the tokenizer appends (Qwen3-Embedding's
        <|endoftext|>, whose last-token pooling reads it): what the tokenizer's own truncation gives."""
        suffix = self._special_suffix
        if suffix and ids[-len(suffix):] == suffix:
            return ids[:self.max_model_len - len(suffix)] + suffix
        return ids[:self.max_model_len]

    @functools.cached_property
    def _vocab_size(self) -> int:
        """Token ids a row may give: the model's vocabulary with the tokenizer's added tokens."""
        return len(self.tokenizer)

    @functools.cached_property
    def _special_suffix(self) -> list[int]:
        """The special tokens the tokenizer appends to a text (none for most decoders)."""
        plain: list[int] = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        full: list[int] = self.tokenizer("a")["input_ids"]
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return full[start + len(plain):]
        return []
