"""The records that flow through every stage.

rows (inputs.readers) -> Request / Failure (inputs.prepare) -> chunks (jobs.chunking) ->
Completion, or Embedding for embedding jobs (engines) -> result and error rows (output.tables, output.embeddings).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True)
class Row:
    """One input row as read, before any interpretation."""

    source: str  # file path
    source_index: int  # position of the file among the job's inputs
    row_index: int  # position of the row in its file (0-based)
    line: int | None  # 1-based line number for JSONL, None for Parquet
    data: dict[str, Any] | None  # None when the line could not be parsed
    error: str | None = None  # why `data` is None
    # why the row cannot be sent although it was read: `data` holds text that is not Unicode (its id may be kept)
    bad_text: str | None = None


@dataclass(frozen=True, slots=True)
class PromptText:
    """A prompt that travels to its engine as its text, which the engine encodes by the driver's rule
    (qbatch/tokens.py): `num_tokens` is the count the driver planned with, checked there."""

    text: str
    add_special_tokens: bool  # False for a chat-templated prompt: the template wrote its special tokens
    num_tokens: int

    def __len__(self) -> int:
        return self.num_tokens

    def __reduce__(self) -> tuple[Any, ...]:
        return PromptText, (self.text, self.add_special_tokens, self.num_tokens)  # as Request's, below


@dataclass(slots=True)
class Request:
    """A validated, tokenized row ready for the engine."""

    id: str
    source_index: int
    row_index: int
    # the prompt's token ids, or its text for the engine to encode (a generated row from text); an engine
    # gives every request of a chunk its ids before it sends them (tokens.encode_prompts)
    tokens: list[int] | PromptText
    # complete vLLM SamplingParams kwargs for this row; an embedding row's is EMBED_SAMPLING (no output
    # tokens: chunk budgets and the longest-first sort count its prompt alone)
    sampling: dict[str, Any]
    thinking: bool | None  # whether the model was asked to think (None: no thinking model)
    extra: dict[str, Any] = field(default_factory=dict)  # carried input columns
    prompt: str | None = None  # the rendered prompt, kept only with --include-prompt
    adapter: str | None = None  # the LoRA adapter's name (EngineSpec.lora); None: the base model

    @property
    def prompt_token_ids(self) -> list[int]:
        """The token ids, once known where this request is (an engine encodes a PromptText first)."""
        if isinstance(self.tokens, PromptText):
            raise ValueError(f"row {self.id}: its prompt is text, not encoded yet (qbatch.tokens.encode_prompts)")
        return self.tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.tokens)

    @property
    def cost(self) -> int:
        """The most tokens this row can occupy: what chunk budgets count."""
        return len(self.tokens) + int(self.sampling["max_tokens"]) * int(self.sampling.get("n", 1))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its fields' values in order: every row of a chunk crosses to a worker process or a Ray
        actor, and a slotted dataclass's own pickling looks its fields up again for each row (~2.5x slower)."""
        return Request, _request_fields(self)


_request_fields = operator.attrgetter(*(f.name for f in fields(Request)))


@dataclass(slots=True)
class Failure:
    """A row that cannot be processed, and why."""

    id: str
    source: str
    row_index: int
    line: int | None
    error: str  # short machine-readable kind, e.g. "prompt_too_long"
    message: str  # what a person should read and do


@dataclass(slots=True)
class Completion:
    """What the engine returned for one request."""

    request: Request
    text: str
    finish_reason: str | None
    num_completion_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine refused the row
    # With logprobs asked: one {"token", "logprob", "top_logprobs": [{"token", "logprob"}]} per output token.
    logprobs: list[dict[str, Any]] | None = None
    more_samples: list[Sample] = field(default_factory=list)  # with n > 1: samples 1..n-1 (this one is 0)

    @property
    def num_generated_tokens(self) -> int:
        """Output tokens of every sample (num_completion_tokens is sample 0's)."""
        return self.num_completion_tokens + sum(s.num_completion_tokens for s in self.more_samples)

    def samples(self) -> list[Sample]:
        """Every sample of the request, this completion's own first."""
        return [Sample(self.text, self.finish_reason, self.num_completion_tokens, self.logprobs), *self.more_samples]


EMBED_SAMPLING: dict[str, Any] = {"max_tokens": 0}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # Qwen3-style reasoning (output/reasoning.py splits at the last close)


@dataclass(slots=True)
class Embedding:
    """What an embedding engine returned for one request: the model's pooled vector, as the model gives it
    (not normalized, all its dimensions: output/embeddings.py truncates and normalizes)."""

    request: Request
    vector: Any  # a 1-D numpy float32 array; None when the engine refused the row
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine refused the row

    # No output: what the writer counts over a chunk's results, as it does for Completions.
    @property
    def num_completion_tokens(self) -> int:
        return 0

    @property
    def num_generated_tokens(self) -> int:
        return 0

    @property
    def more_samples(self) -> list[Sample]:
        return []


@dataclass(slots=True)
class Sample:
    """One of a request's n samples (vLLM's CompletionOutput)."""

    text: str
    finish_reason: str | None
    num_completion_tokens: int
    logprobs: list[dict[str, Any]] | None = None
