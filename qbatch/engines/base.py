"""What every engine is: the Engine protocol, the Chunk it takes, and the null stand-in.

An engine takes a stream of chunks and yields their rows back as they finish: a chunk with
the completions of some of its rows, a chunk's rows in one or more such pieces, each row in
exactly one. Implementations (vllm.py, processes.py, ray_actors.py) import this module; the
pool (pool.py) starts one of them.
"""

from __future__ import annotations

import json
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from enum import Enum
from typing import Any, Final, Protocol

from qbatch.records import Completion, Embedding, Request, Sample



class _End(Enum):
    END = "end"


END: Final = _End.END  # end of a chunk stream
STARTUP_TIMEOUT_S = 1800.0  # an engine worker or actor that has not started by then is given up
# An engine yields the rows finished since its last yield about this often (None when there are
# none): the progress bar moves with them, the runner writes parts on time (jobs/parts.py), and the
# rows' texts are still decoded, and sent back by worker processes, in batches.
REPORT_S = 0.5


FinishedRows = list[Completion] | list[Embedding]  # a chunk's rows an engine has finished


@dataclass(slots=True)
class Chunk:
    index: int
    requests: list[Request]
    # Someone waits on each of its rows (an online request: serve/gather.py): an engine returns them at the
    # step they finish, not at its next REPORT_S, which would add up to that much to every answer and hold
    # back each client's next request. A run's chunks leave it off: a message a step would cost the
    # coordinator, whose per-row time bounds a run (docs/benchmarks.md#prompts-as-text).
    urgent: bool = False


class Stream:
    """A chunk stream with a side door for urgent chunks: an engine that has no room for the stream's next
    chunk (its requests in flight at their cap) still takes an urgent one at once, at its next step.

    Without it an online request that arrived while a batch filled the engines waited for the batch's
    first rows to end (~6 s on an H100 beside an 8,192-row batch: docs/benchmarks.md#h100-63).
    `urgent()` returns such a chunk, taken, or None; a plain iterable has none (`urgent_door`).
    """

    def __init__(self, chunks: Iterable[Chunk | None], urgent: Callable[[], Chunk | None]):
        self._chunks, self.urgent = chunks, urgent

    def __iter__(self) -> Iterator[Chunk | None]:
        return iter(self._chunks)


def urgent_door(chunks: Iterable[Chunk | None]) -> Callable[[], Chunk | None]:
    """The stream's door for urgent chunks (Stream), or one that never has any."""
    return getattr(chunks, "urgent", None) or _no_urgent


def _no_urgent() -> None:
    return None


class Engine(Protocol):
    """Takes chunks (a `None` item means "nothing ready yet, keep generating") and yields rows
    as they finish: `(chunk, completions)` with the completions of some of the chunk's rows (each
    carries its request), or now and then `None` while no row finished (the consumer's clock)."""

    def run(self, chunks: Iterable[Chunk | None]) -> Iterator[tuple[Chunk, FinishedRows] | None]: ...


class NullEngine:
    """Returns instantly: measures qbatch's own pipeline and tests chunking and I/O.

    With `embedding_size` it is an embedding engine: each row's vector is a fixed function of its
    token ids (identical inputs, identical vectors), unnormalized as a model's pooled output is.
    """

    embedding_size: int | None = None  # set: an embedding engine

    def __init__(self, embedding_size: int | None = None):
        self.embedding_size = embedding_size

    def run(self, chunks: Iterable[Chunk | None]) -> Iterator[tuple[Chunk, list[Any]]]:
        for chunk in chunks:
            if chunk is None:
                continue
            if self.embedding_size is not None:
                yield chunk, self._embed(chunk.requests, self.embedding_size)
            else:
                yield chunk, [self._complete(r) for r in chunk.requests]

    def _embed(self, requests: list[Request], size: int) -> list[Embedding]:
        """Sine waves whose phase is a hash of the token ids: one numpy call a chunk, no per-row generator."""
        import numpy as np

        phases = np.array([zlib.crc32(array("I", r.prompt_token_ids).tobytes()) for r in requests],
                          dtype=np.float64) / 2**32 * 2 * np.pi
        waves = np.arange(1, size + 1, dtype=np.float64)
        vectors = (3.0 * np.sin(np.outer(phases + 0.1, waves) + waves)).astype(np.float32)
        return [Embedding(r, vectors[i]) for i, r in enumerate(requests)]

    @staticmethod
    def _complete(r: Request) -> Completion:
        text = f"[null engine: {r.num_prompt_tokens} prompt tokens]"
        more = [Sample(f"{text} #{i}", "length", r.sampling["max_tokens"]) for i in range(1, r.sampling.get("n", 1))]
        return Completion(r, text, "length", r.sampling["max_tokens"], more_samples=more)


NULL_EMBEDDING_SIZE = 1024  # the null engine's vectors when the model's config gives no size (Qwen3-0.6B's)


def hidden_size(model_path: str) -> int | None:
    """The size of the model's hidden states, which its embeddings are (config.json); None when it does not say."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config") or config if isinstance(config, dict) else {}
    value = config.get("hidden_size") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def vector_size(model_path: str, backend: str) -> int | None:
    """The size of the vectors an embedding engine returns (before --dimensions): the model's hidden
    size; the null engine's stand-in size when the config does not say; None when unknown."""
    size = hidden_size(model_path)
    return NULL_EMBEDDING_SIZE if size is None and backend == "null" else size
