"""Many engines behind one coordinator: hand chunks out, collect them back, redo a dead worker's chunks.

Shared by the one-host backend (parallel.py, worker processes) and the Ray
backend (cluster.py, actors); they differ only in how a chunk travels. The
coordinator stays the only writer of OUT_DIR, so a chunk is written once,
whichever worker finished it, and a worker that dies loses only its chunks
in flight: they go to the others. Also here: what every worker runs around
its engine (core binding, its chunk feed, its answers).
"""

from __future__ import annotations

import os
import queue
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from qbatch.engine import END, Chunk
from qbatch.errors import EngineError
from qbatch.records import Completion
from qbatch.spec import EngineSpec

CHUNKS_PER_WORKER = 3  # queued ahead so a worker never waits for its next chunk
POLL_S = 1.0
STOP = "stop"
RESUME_HINT = "finished parts are kept; rerun the same command to resume"

# A completion as it travels back from a worker: text, finish_reason, completion tokens, cached tokens, error.
Output = tuple[str, str | None, int, int, str | None]
# What a worker reports: ("done", rank, chunk index, outputs) or ("failed", rank, why).
Message = tuple[Any, ...]


@dataclass
class Worker:
    rank: int
    label: str  # how messages name it, e.g. "worker 1 (device 1)"
    handle: Any  # the transport's own: a process and its queue, a Ray actor
    outstanding: dict[int, Chunk] = field(default_factory=dict)


class Dispatcher:
    """The Engine protocol over workers; a subclass says how chunks travel (`_send`, `_receive`, `_is_alive`)."""

    max_num_seqs: int

    def __init__(self) -> None:
        self._workers: dict[int, Worker] = {}

    def run(self, chunks: Iterable[Chunk | None]) -> Iterator[tuple[Chunk, list[Completion]]]:
        source = iter(chunks)
        retry: deque[Chunk] = deque()
        exhausted = False
        while True:
            exhausted = self._hand_out(source, retry, exhausted)
            if exhausted and not retry and not any(w.outstanding for w in self._workers.values()):
                return
            message = self._receive(POLL_S)
            if message is None:
                self._reap(retry)
                continue
            if message[0] == "failed":
                worker = self._workers.get(message[1])
                raise EngineError(f"the engine failed in {worker.label if worker else message[1]}: {message[2]}",
                                  hint=RESUME_HINT)
            _, rank, index, outputs = message
            worker = self._workers.get(rank)
            chunk = worker.outstanding.pop(index, None) if worker else None
            if chunk is not None:  # None: a late answer of a worker already given up
                yield chunk, [Completion(request, *output) for request, output in zip(chunk.requests, outputs)]

    def _hand_out(self, source: Iterator[Chunk | None], retry: deque[Chunk], exhausted: bool) -> bool:
        for worker in sorted(self._workers.values(), key=lambda w: len(w.outstanding)):
            while len(worker.outstanding) < CHUNKS_PER_WORKER:
                chunk = retry.popleft() if retry else (END if exhausted else next(source, END))
                if chunk is END:
                    return True
                if chunk is None:
                    break
                worker.outstanding[chunk.index] = chunk
                self._send(worker, slim(chunk))
        return exhausted

    def _reap(self, retry: deque[Chunk]) -> None:
        """Give the chunks of dead workers to the living; fail when none is left."""
        for worker in [w for w in self._workers.values() if not self._is_alive(w)]:
            retry.extend(worker.outstanding.values())
            del self._workers[worker.rank]
            print(f"qbatch: engine {worker.label} died; {len(worker.outstanding)} chunks go to the others", flush=True)
        if not self._workers:
            raise EngineError("every engine worker died", hint=RESUME_HINT)

    def _send(self, worker: Worker, chunk: Chunk) -> None:
        raise NotImplementedError

    def _receive(self, timeout: float) -> Message | None:
        """The next worker message, or None after `timeout` seconds without one (or after a worker died)."""
        raise NotImplementedError

    def _is_alive(self, worker: Worker) -> bool:
        raise NotImplementedError


def slim(chunk: Chunk) -> Chunk:
    """The chunk as a worker needs it: token ids and sampling, not the carried columns or prompt text."""
    return Chunk(chunk.index, [replace(r, extra={}, prompt=None) for r in chunk.requests])


def pack(completions: list[Completion]) -> list[Output]:
    """Completions without their requests: the coordinator still holds those."""
    return [(c.text, c.finish_reason, c.num_completion_tokens, c.num_cached_tokens, c.error) for c in completions]


def start_engine(spec: EngineSpec, model_path: str, max_model_len: int, local_rank: int, local_world: int) -> Any:
    """A worker's vLLM engine; on the CPU, engines sharing a host each get their own cores."""
    from qbatch.engine import VllmEngine, _on_cpu

    if _on_cpu() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # their OpenMP threads would otherwise fight over every core
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[local_rank::local_world] or cores))
    return VllmEngine(spec, model_path, max_model_len)


def feed(tasks: Any, orphaned: Callable[[], bool] = lambda: False) -> Iterator[Chunk | None]:
    """Chunks from the coordinator's queue until STOP; None while none is waiting (the engine keeps generating)."""
    while not orphaned():
        try:
            item = tasks.get(timeout=0.005)
        except queue.Empty:
            yield None
            continue
        if item == STOP:
            return
        yield item
