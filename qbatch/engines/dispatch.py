"""Many engines behind one coordinator: hand chunks out, collect them back, redo a dead worker's chunks.

Workers pull: a worker asks for a chunk ("want") whenever its engine has room
for more requests (fewer than FEED_FACTOR x max_num_seqs in flight), and the
coordinator answers with the next chunk. Counting whole chunks instead starves
engines: a chunk stays open until its longest row ends, so most of the rows a
worker "holds" are long finished (two H200s reached 1.53x one, not 2x), and
chunks pushed ahead pile up behind one engine while another goes idle at the end.

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
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from qbatch.engines.vllm import END, Chunk
from qbatch.errors import EngineError
from qbatch.records import Completion
from qbatch.spec import EngineSpec

POLL_S = 1.0
STOP = "stop"
RESUME_HINT = "finished parts are kept; rerun the same command to resume"

# A completion as it travels back from a worker: text, finish_reason, completion tokens, cached tokens, error.
Output = tuple[str, str | None, int, int, str | None]
# What a worker reports: ("want", rank), ("done", rank, chunk index, outputs) or ("failed", rank, why).
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
    engine_seqs: int = 0  # one engine's max_num_seqs (0: not known, no cap while others start)

    def __init__(self) -> None:
        self._workers: dict[int, Worker] = {}
        self._wanting: deque[int] = deque()  # workers that asked for a chunk, in order of asking
        self._starting: set[int] = set()  # workers whose engine is not ready yet (they join the run when it is)

    def run(self, chunks: Iterable[Chunk | None]) -> Iterator[tuple[Chunk, list[Completion]]]:
        source = iter(chunks)
        retry: deque[Chunk] = deque()
        exhausted, reaped = False, time.monotonic()
        while True:
            exhausted = self._hand_out(source, retry, exhausted)
            if exhausted and not retry and not any(w.outstanding for w in self._workers.values()):
                return
            message = self._receive(POLL_S)
            if message is None or time.monotonic() - reaped > POLL_S:  # even while other workers keep talking
                self._reap(retry)
                reaped = time.monotonic()
            if message is None or self._note(message):
                continue
            kind, rank = message[0], message[1]
            worker = self._workers.get(rank)
            if kind == "failed":
                raise EngineError(f"the engine failed in {worker.label if worker else rank}: {message[2]}",
                                  hint=RESUME_HINT)
            chunk = worker.outstanding.pop(message[2], None) if worker else None
            if chunk is not None:  # None: a late answer of a worker already given up
                yield chunk, [Completion(request, *output) for request, output in zip(chunk.requests, message[3])]

    def wait_started(self) -> None:
        """Return once every engine has started (or failed to): a benchmark times runs on all of them."""
        while self._starting:
            message = self._receive(POLL_S)
            if message is None:
                self._reap(deque())  # also forgets a dead worker that was starting
            elif not self._note(message):
                raise EngineError(f"unexpected message from an engine worker while starting: {message[:2]}")

    def _note(self, message: Message) -> bool:
        """Handle a worker asking for work, or starting (or failing to); False for anything else."""
        kind, rank = message[0], message[1]
        worker = self._workers.get(rank)
        label = worker.label if worker else rank
        if kind == "want":
            if rank not in self._wanting:
                self._wanting.append(rank)
        elif kind == "ready":
            self._starting.discard(rank)
            print(f"qbatch: engine {label} ready, joins the run", flush=True)
        elif kind == "failed" and rank in self._starting:
            self._starting.discard(rank)
            self._workers.pop(rank, None)  # nothing handed to it yet; its process exits on its own
            print(f"qbatch: warning: engine {label} could not start, the run goes on without it: {message[2]}",
                  flush=True)
            if not self._workers:
                raise EngineError("no engine could start", hint="see the warnings above")
        else:
            return False
        return True

    def _hand_out(self, source: Iterator[Chunk | None], retry: deque[Chunk], exhausted: bool) -> bool:
        """A chunk for each worker that asked (a dead worker's chunks first); True once the source is done."""
        while (worker := self._next_wanting()) is not None:
            chunk = retry.popleft() if retry else (END if exhausted else next(source, END))
            if chunk is END:
                return True
            if chunk is None:  # nothing ready yet
                return exhausted
            self._wanting.remove(worker.rank)
            worker.outstanding[chunk.index] = chunk
            self._send(worker, slim(chunk))
        return exhausted

    def _next_wanting(self) -> Worker | None:
        """The first worker that asked and may take a chunk now (forgetting those that died since).

        While other engines are still starting, a running one gets no more rows than it runs at
        once: rows waiting in it cannot move to the others when they join (on one H200, the first
        of two engines took 3/4 of a 4,096-row job before the second was ready).
        """
        self._wanting = deque(rank for rank in self._wanting if rank in self._workers)
        for rank in self._wanting:
            worker = self._workers[rank]
            if not (self._starting and self.engine_seqs) or _rows(worker) < self.engine_seqs:
                return worker
        return None

    def _reap(self, retry: deque[Chunk]) -> None:
        """Give the chunks of dead workers to the living; fail when none is left."""
        for worker in [w for w in self._workers.values() if not self._is_alive(w)]:
            retry.extend(worker.outstanding.values())
            del self._workers[worker.rank]
            self._starting.discard(worker.rank)
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


def _rows(worker: Worker) -> int:
    return sum(len(chunk.requests) for chunk in worker.outstanding.values())


def slim(chunk: Chunk) -> Chunk:
    """The chunk as a worker needs it: token ids and sampling, not the carried columns or prompt text."""
    return Chunk(chunk.index, [replace(r, extra={}, prompt=None) for r in chunk.requests])


def pack(completions: list[Completion]) -> list[Output]:
    """Completions without their requests: the coordinator still holds those."""
    return [(c.text, c.finish_reason, c.num_completion_tokens, c.num_cached_tokens, c.error) for c in completions]


def start_engine(spec: EngineSpec, model_path: str, max_model_len: int, local_rank: int, local_world: int) -> Any:
    """A worker's vLLM engine; on the CPU, engines sharing a host each get their own cores."""
    from qbatch.engines.vllm import VllmEngine, _on_cpu

    if _on_cpu() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # their OpenMP threads would otherwise fight over every core
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[local_rank::local_world] or cores))
    return VllmEngine(spec, model_path, max_model_len)


def feed(tasks: Any, ask: Callable[[], None], orphaned: Callable[[], bool] = lambda: False) -> Iterator[Chunk | None]:
    """A worker's chunks from the coordinator, until STOP.

    The engine draws from it whenever it has room; when no chunk is waiting this asks the
    coordinator for one (once until it comes) and yields None, so the engine keeps generating.
    """
    asked = False
    while not orphaned():
        try:
            item = tasks.get_nowait()
        except queue.Empty:
            if not asked:
                ask()
                asked = True
            yield None
            continue
        if item == STOP:
            return
        asked = False
        yield item
