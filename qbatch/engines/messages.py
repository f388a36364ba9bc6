"""What a coordinator and its engine workers say to each other (dispatch.py, processes.py, ray_actors.py).

Small frozen dataclasses: they travel pickled, between spawned processes or Ray actors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qbatch.errors import QbatchError
from qbatch.records import Completion, Embedding, Request, Sample


@dataclass(frozen=True, slots=True)
class Output:
    """A completion as it travels back from a worker, without its request (the coordinator holds that)."""

    text: str
    finish_reason: str | None
    num_completion_tokens: int
    num_cached_tokens: int
    error: str | None
    logprobs: list[dict[str, Any]] | None = None
    more_samples: tuple[Sample, ...] = ()  # with n > 1: samples 1..n-1

    @classmethod
    def of(cls, completion: Completion) -> Output:
        return cls(completion.text, completion.finish_reason, completion.num_completion_tokens,
                   completion.num_cached_tokens, completion.error, completion.logprobs,
                   tuple(completion.more_samples))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its fields' values (every row comes back so), as records.Request is."""
        return Output, (self.text, self.finish_reason, self.num_completion_tokens, self.num_cached_tokens,
                        self.error, self.logprobs, self.more_samples)


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    """An embedding as it travels back from a worker, without its request."""

    vector: Any  # numpy float32, 1-D; None when refused
    num_cached_tokens: int
    error: str | None

    @classmethod
    def of(cls, embedding: Embedding) -> EmbeddingOutput:
        return cls(embedding.vector, embedding.num_cached_tokens, embedding.error)


@dataclass(frozen=True, slots=True)
class Want:
    """The worker's engine has room for another chunk."""

    rank: int


@dataclass(frozen=True, slots=True)
class Ready:
    """The worker's engine has started; it runs up to max_num_seqs sequences at once."""

    rank: int
    max_num_seqs: int


@dataclass(frozen=True, slots=True)
class Finished:
    """Rows of a chunk finished: their positions in the chunk as it travelled, and their outputs in that
    order (a chunk's rows come back in one or more of these, each row in one)."""

    rank: int
    chunk_index: int
    positions: list[int]
    outputs: list[Output] | list[EmbeddingOutput]


@dataclass(frozen=True, slots=True)
class Failed:
    """The worker's engine could not start, or failed while running.

    A qbatch error travels whole (`error`): its kind and hint (too little memory, a missing
    model) are the answer the coordinator gives.
    """

    rank: int
    reason: str
    error: QbatchError | None = None


@dataclass(frozen=True, slots=True)
class EngineSample:
    """An engine's counters at one moment, for telemetry (read once a second, never per step).

    Counts since the engine started: finished requests and their prompt, prefix-cached and generated
    tokens (qbatch counts them as requests finish). Running / waiting requests and KV-cache usage are
    vLLM's scheduler stats: None unless the engine runs with disable_log_stats=False.
    """

    requests_in_engine: int
    finished_requests: int
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    requests_running: int | None = None
    requests_waiting: int | None = None
    kv_cache_usage: float | None = None  # 0..1


@dataclass(frozen=True, slots=True)
class Stats:
    """A worker's engine counters, sent about once a second (telemetry)."""

    rank: int
    sample: EngineSample


@dataclass(frozen=True, slots=True)
class Stop:
    """To a worker: no more chunks, shut the engine down."""


@dataclass(frozen=True, slots=True)
class Drop:
    """To a worker: abort the requests of every chunk you hold (their run stopped early), then go on."""


Message = Want | Ready | Finished | Failed | Stats


def pack(completions: list[Completion] | list[Embedding]) -> list[Output] | list[EmbeddingOutput]:
    """Completions (or embeddings) without their requests: the coordinator still holds those."""
    if completions and isinstance(completions[0], Embedding):
        return [EmbeddingOutput.of(c) for c in completions if isinstance(c, Embedding)]
    return [Output.of(c) for c in completions if isinstance(c, Completion)]


def unpack(requests: list[Request], outputs: list[Output] | list[EmbeddingOutput]) -> list[Completion] | list[Embedding]:
    """The completions (or embeddings) of requests from the outputs a worker sent back for them, in their order."""
    if len(requests) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs for {len(requests)} requests")
    if outputs and isinstance(outputs[0], EmbeddingOutput):
        return [Embedding(request, o.vector, o.num_cached_tokens, o.error)
                for request, o in zip(requests, outputs) if isinstance(o, EmbeddingOutput)]
    return [Completion(request, o.text, o.finish_reason, o.num_completion_tokens, o.num_cached_tokens, o.error,
                       o.logprobs, list(o.more_samples))
            for request, o in zip(requests, outputs) if isinstance(o, Output)]
