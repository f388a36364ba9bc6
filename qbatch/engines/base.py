"""What every engine is: the Engine protocol, the Chunk it takes, and the null stand-in.

An engine takes a stream of chunks and yields each chunk back with its completions as
soon as all of its rows are finished. Implementations (vllm.py, processes.py,
ray_actors.py) import this module; the factory (factory.py) picks one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from qbatch.records import Completion, Request, Sample

END = object()  # end of a chunk stream
STARTUP_TIMEOUT_S = 1800.0  # an engine worker or actor that has not started by then is given up


@dataclass(slots=True)
class Chunk:
    index: int
    requests: list[Request]


class Engine(Protocol):
    """Takes chunks (a `None` item means "nothing ready yet, keep generating") and yields
    each chunk with its completions, in order of completion."""

    def run(self, chunks: Iterable[Chunk | None]) -> Iterator[tuple[Chunk, list[Completion]]]: ...


class NullEngine:
    """Returns instantly: measures qbatch's own pipeline and tests planning and I/O."""

    def run(self, chunks: Iterable[Chunk | None]) -> Iterator[tuple[Chunk, list[Completion]]]:
        for chunk in chunks:
            if chunk is None:
                continue
            yield chunk, [self._complete(r) for r in chunk.requests]

    @staticmethod
    def _complete(r: Request) -> Completion:
        text = f"[null engine: {r.num_prompt_tokens} prompt tokens]"
        more = [Sample(f"{text} #{i}", "length", r.sampling["max_tokens"]) for i in range(1, r.sampling.get("n", 1))]
        return Completion(r, text, "length", r.sampling["max_tokens"], more_samples=more)
