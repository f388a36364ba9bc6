"""OpenAI's online request and response objects, as pydantic models FastAPI validates (online.py).

The request models check types only: a body that is not an object, a message without a role, `n`
as text, are a 400 before anything else runs. The values' rules (ranges, stop lists, a schema, the
keys qbatch applies) are the Preparer's, the same as for a batch line (inputs/validate.py), so an
online request and the same body on a batch line are refused, or answered, alike. Keys these models
do not name pass through to that check (a setting qbatch does not apply fails, never silently).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    """Other keys are kept (vLLM's extensions, OpenAI's newer ones): the Preparer decides about them."""

    model_config = ConfigDict(extra="allow")


class ChatMessage(_Open):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StreamOptions(_Open):
    include_usage: bool = False


class _Generation(_Open):
    """What chat and text completions share: OpenAI's sampling keys and vLLM's extensions."""

    model: str
    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    response_format: ResponseFormat | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: {"enable_thinking": false}


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: bool | int | None = None


class EmbeddingRequest(_Open):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    dimensions: int | None = None
    encoding_format: Literal["float", "base64"] | None = None


# -- responses -----------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # the reasoning apart from the answer, under vLLM's two names (`reasoning_content`, read by LangChain's
    # reasoning-aware models, and `reasoning`, the name of a batch's output lines)
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class ChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class TextCompletionChunk(BaseModel):
    """A streamed text completion: OpenAI's legacy API streams `text_completion` objects."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None


class EmbeddingItem(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32 (encoding_format "base64")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage
