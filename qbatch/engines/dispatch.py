"""Many engines behind one coordinator: hand chunks out, collect them back, redo a dead worker's chunks.

Workers pull: a worker asks for a chunk (Want) whenever its engine has room
for more requests (fewer than FEED_FACTOR x max_num_seqs in flight), and the
coordinator answers with the next chunk. Counting whole chunks instead starves
engines: a chunk stays open until its longest row ends, so most of the rows a
worker "holds" are long finished, and chunks pushed ahead pile up behind one
engine while another goes idle at the end (docs/benchmarks.md, data parallel).

A chunk travels under a number of the coordinator's own, never reused: its
index counts from 0 in each run, and engines kept warm between runs (a
Session, `qbatch serve`) may still answer a chunk of a run that stopped early
(Ctrl-C, a cancelled batch). Such an answer is dropped, never taken for the
chunk of the same index in the next run, and a run that ends early tells the
workers to drop the chunks they hold (`_abandon`).

Rows come back as they finish, named by their position in the chunk as it
travelled (`Finished`), so a chunk's rows come back in several answers; the
coordinator notes which rows each held chunk has answered.

Shared by the one-host backend (processes.py, worker processes) and the Ray
backend (ray_actors.py, actors); they differ only in how a chunk travels. The
coordinator stays the only writer of OUT_DIR, so a row is written once,
whichever worker finished it, and a worker that dies loses only its rows in
flight: the rows of its chunks not answered yet go to the others. Also here:
what every worker runs around its engine (core binding, its chunk feed, its
answers).
"""

from __future__ import annotations

import itertools
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from qbatch.engines import compile_cache
from qbatch.engines.base import END, REPORT_S, Chunk, FinishedRows, urgent_door
from qbatch.engines.config import EngineConfig
from qbatch.engines.messages import (Drop, EngineSample, Failed, Finished, Message, Ready, Stats, Stop, Want, pack,
                                     unpack)
from qbatch.engines.platform import bind_cpu_cores
from qbatch.engines.vllm import VllmEngine
from qbatch.engines.vllm_output import EngineLog
from qbatch.errors import EngineError
from qbatch.log import log
from qbatch.records import Completion, Request

POLL_S = 1.0
# How long the coordinator waits for a worker's message while a worker wants work and the source has none
# ready (a live feed: serve's online queue), or while the source has an urgent door (base.Stream: serve's
# runs), before it asks the source again: a request that arrives then waits this long, not until some
# worker next speaks (up to POLL_S). A run's own source is never "not ready" and has no such door.
# Its value, and what a shorter one cost on a 2-core CPU: docs/benchmarks.md#online-waits.
LIVE_POLL_S = 0.02
STATS_S = 1.0  # a worker sends its engine's counters this often (telemetry)
RESUME_HINT = "finished parts are kept; rerun the same command to resume"


@dataclass
class Held:
    """A chunk out with a worker, and the positions of its rows answered so far."""

    chunk: Chunk
    answered: set[int] = field(default_factory=set)

    @property
    def num_left(self) -> int:
        return len(self.chunk.requests) - len(self.answered)

    def left(self) -> Chunk:
        """Its rows not answered yet, as a chunk of the same index (for another worker)."""
        return Chunk(self.chunk.index, [r for i, r in enumerate(self.chunk.requests) if i not in self.answered],
                     self.chunk.urgent)


@dataclass
class Worker:
    rank: int
    label: str  # how messages name it, e.g. "worker 1 (device 1)"
    handle: Any  # the transport's own: a process and its queue, a Ray actor
    outstanding: dict[int, Held] = field(default_factory=dict)  # by the number the chunk travels under


class Dispatcher:
    """The Engine protocol over workers; a subclass says how chunks travel (`_send`, `_receive`, `_is_alive`)."""

    engine_seqs: int = 0  # one engine's max_num_seqs (0: not known, no cap while others start)
    engine_log = EngineLog(None)  # where the workers' engines write (shown when one fails)

    def __init__(self) -> None:
        self._workers: dict[int, Worker] = {}
        self._wanting: deque[int] = deque()  # workers that asked for a chunk, in order of asking
        self._starting: set[int] = set()  # workers whose engine is not ready yet (they join the run when it is)
        self._samples: dict[int, EngineSample] = {}  # each worker's latest counters (telemetry)
        self._numbers = itertools.count()  # what a chunk travels as: unique across runs
        self.started_at = time.monotonic()  # the engines' start: each one's ready time is logged from it

    def telemetry(self) -> list[tuple[str, EngineSample]]:
        """Each live worker's latest engine counters, by its label (sent about once a second)."""
        return [(w.label, self._samples[rank]) for rank, w in list(self._workers.items()) if rank in self._samples]

    def run(self, chunks: Iterable[Chunk | None]) -> Iterator[tuple[Chunk, FinishedRows] | None]:
        self._abandon()  # what a run that stopped early left (its consumer may not have closed it)
        try:
            yield from self._run(iter(chunks), urgent_door(chunks), hasattr(chunks, "urgent"))
        except BaseException:  # an error, Ctrl-C, a consumer that stopped: the engines drop this run's chunks
            self._abandon()
            raise

    def _run(self, source: Iterator[Chunk | None], take_urgent: Callable[[], Chunk | None],
             live: bool) -> Iterator[tuple[Chunk, FinishedRows] | None]:
        retry: deque[Chunk] = deque()
        exhausted, reaped = False, time.monotonic()
        reported = reaped
        while True:
            if time.monotonic() - reported >= REPORT_S:  # no row came back for that long: the consumer's clock
                reported = time.monotonic()
                yield None
            exhausted = self._hand_out(source, retry, exhausted)
            while (chunk := take_urgent()) is not None:
                self._push(chunk, retry)
            if exhausted and not retry and not any(w.outstanding for w in self._workers.values()):
                return
            # the source had nothing ready for a worker that asked, or may have an urgent chunk any time
            waiting = live or (not exhausted and self._next_wanting() is not None)
            message = self._receive(LIVE_POLL_S if waiting else POLL_S)
            if (message is None and not waiting) or time.monotonic() - reaped > POLL_S:  # even while others talk
                self._reap(retry)
                reaped = time.monotonic()
            if message is None or self._note(message):
                continue
            worker = self._workers.get(message.rank)
            match message:
                case Failed(rank=rank, reason=reason):
                    self.engine_log.show_tail()
                    raise EngineError(f"the engine failed in {worker.label if worker else rank}: {reason}",
                                      hint=RESUME_HINT)
                case Finished(chunk_index=number, positions=positions, outputs=outputs):
                    held = worker.outstanding.get(number) if worker else None
                    if worker is None or held is None:  # a late answer of a worker given up, or of an earlier run
                        continue
                    held.answered.update(positions)
                    if not held.num_left:
                        del worker.outstanding[number]
                    reported = time.monotonic()
                    yield held.chunk, unpack([held.chunk.requests[p] for p in positions], outputs)

    def wait_started(self) -> None:
        """Return once every engine has started (or failed to): a benchmark times runs on all of them."""
        while self._starting:
            message = self._receive(POLL_S)
            if message is None:
                self._reap(deque())  # also forgets a dead worker that was starting
            elif not self._note(message):
                raise EngineError(f"unexpected message from an engine worker while starting: {message}")

    def _note(self, message: Message) -> bool:
        """Handle a worker asking for work, or starting (or failing to); False for anything else."""
        rank = message.rank
        worker = self._workers.get(rank)
        label = worker.label if worker else rank
        match message:
            case Want():
                if rank not in self._wanting:
                    self._wanting.append(rank)
            case Stats(sample=sample):
                self._samples[rank] = sample
            case Ready():
                self._starting.discard(rank)
                log.info("engine %s ready %.1fs after the engines started, joins the run", label,
                         time.monotonic() - self.started_at)
            case Failed(reason=reason) if rank in self._starting:
                self._starting.discard(rank)
                self._workers.pop(rank, None)  # nothing handed to it yet; its process exits on its own
                log.warning("engine %s could not start, the run goes on without it: %s", label, reason)
                if not self._workers:
                    raise EngineError("no engine could start", hint="see the warnings above")
            case _:
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
            number = next(self._numbers)
            worker.outstanding[number] = Held(chunk)
            self._send(worker, slim(chunk, number))
        return exhausted

    def _push(self, chunk: Chunk, retry: deque[Chunk]) -> None:
        """An urgent chunk to the engine that asked first, else to the running one with the fewest rows,
        asked or not: it goes in at that engine's next step, room or not (Feed.urgent)."""
        worker = self._next_wanting()
        if worker is not None:
            self._wanting.remove(worker.rank)
        else:
            running = [w for rank, w in self._workers.items() if rank not in self._starting]
            if not running:  # the first engine is not ready yet: it goes to whichever asks first
                retry.appendleft(chunk)
                return
            worker = min(running, key=_rows)
        number = next(self._numbers)
        worker.outstanding[number] = Held(chunk)
        self._send(worker, slim(chunk, number))

    def _abandon(self) -> None:
        """Forget the chunks workers still hold (a run that stopped early) and tell them to drop theirs."""
        for worker in self._workers.values():
            if worker.outstanding:
                worker.outstanding.clear()
                self._drop(worker)

    def _drop(self, worker: Worker) -> None:
        """Tell a worker to abort the requests of the chunks it holds, where the transport keeps the
        order of what it sends (a worker process's queue; not Ray's concurrent actor calls, whose
        engines finish such chunks instead). Their late answers are dropped either way."""

    def _next_wanting(self) -> Worker | None:
        """The first worker that asked and may take a chunk now (forgetting those that died since).

        While other engines are still starting, a running one gets no more rows than it runs at
        once: rows waiting in it cannot move to the others when they join, and without this cap
        the first engine ready takes most of a job (docs/benchmarks.md, data parallel).
        """
        self._wanting = deque(rank for rank in self._wanting if rank in self._workers)
        for rank in self._wanting:
            worker = self._workers[rank]
            if not (self._starting and self.engine_seqs) or _rows(worker) < self.engine_seqs:
                return worker
        return None

    def _reap(self, retry: deque[Chunk]) -> None:
        """Give the rows dead workers had not answered to the living; fail when none is left."""
        for worker in [w for w in self._workers.values() if not self._is_alive(w)]:
            retry.extend(held.left() for held in worker.outstanding.values())
            del self._workers[worker.rank]
            self._starting.discard(worker.rank)
            log.warning("engine %s died; its %d rows in flight (%d chunks) go to the others", worker.label,
                        _rows(worker), len(worker.outstanding))
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
    return sum(held.num_left for held in worker.outstanding.values())


def slim(chunk: Chunk, number: int) -> Chunk:
    """The chunk as a worker needs it, numbered as it travels: each row's prompt (its token ids, or its text:
    records.PromptText), sampling and LoRA adapter's name, not the carried columns nor --include-prompt's copy."""
    # not dataclasses.replace, which reads the fields anew for every row
    return Chunk(number, [Request(r.id, r.source_index, r.row_index, r.tokens, r.sampling, r.thinking, {}, None,
                                  r.adapter) for r in chunk.requests], chunk.urgent)


def start_engine(config: EngineConfig, local_rank: int, local_world: int) -> Any:
    """A worker's vLLM engine, its environment the plan's (plan/environment.py). A Ray node's folders and cores
    are its own: an actor's engine puts its compile cache there and, on the CPU, takes its share of them."""
    if config.backend == "ray":
        compile_cache.use_cache_root()
        if config.platform == "cpu":
            bind_cpu_cores(local_rank, local_world)
    return VllmEngine(config, local_rank)


def send_stats(engine: Any, rank: int, put: Callable[[Message], None], stopped: Any) -> None:
    """Start a thread that sends the engine's counters every STATS_S seconds until `stopped` is set:
    read from the engine's own counters, so the engine loop does no work for it."""
    import threading

    def send() -> None:
        while not stopped.wait(STATS_S):
            try:
                put(Stats(rank, engine.sample()))
            except Exception:  # a queue closed at shutdown: telemetry is never worth a failed run
                return

    threading.Thread(target=send, name="qbatch-engine-stats", daemon=True).start()


@dataclass(slots=True)
class Answering:
    """A chunk a worker's engine runs: where each of its requests stands in it, and how many are unanswered."""

    positions: dict[int, int]  # id(request) -> its position in the chunk
    num_left: int


class Answers:
    """A worker's answers: its engine's finished rows as Finished messages, each row named by its
    position in the chunk as it came (the coordinator holds the requests)."""

    def __init__(self, rank: int):
        self.rank = rank
        self._chunks: dict[int, Answering] = {}

    def finished(self, chunk: Chunk, completions: list[Any]) -> tuple[Finished, bool]:
        """The message for rows of `chunk` that finished, and whether they were its last."""
        answering = self._chunks.get(chunk.index)
        if answering is None:
            answering = self._chunks[chunk.index] = Answering({id(r): i for i, r in enumerate(chunk.requests)},
                                                              len(chunk.requests))
        answering.num_left -= len(completions)
        if not answering.num_left:
            del self._chunks[chunk.index]
        positions = [answering.positions[id(c.request)] for c in completions]
        return Finished(self.rank, chunk.index, positions, pack(completions)), not answering.num_left


class Dropped(Exception):
    """Raised through a worker's engine loop: the coordinator dropped the chunks it holds."""


class Feed:
    """A worker's chunks from the coordinator, until Stop: a Stream (base.py) whose urgent door takes an
    online chunk the coordinator sent unasked while the engine had no room (Dispatcher._push).

    The engine draws from it whenever it has room; when no chunk is waiting this asks the
    coordinator for one (once until one comes) and yields None, so the engine keeps generating.
    """

    def __init__(self, tasks: Any, ask: Callable[[], None], orphaned: Callable[[], bool] = lambda: False):
        self._tasks, self._ask, self._orphaned = tasks, ask, orphaned
        self._asked = False
        self._kept: deque[Any] = deque()  # what the urgent door took from the queue that was not urgent, in order

    def __iter__(self) -> Iterator[Chunk | None]:
        while not self._orphaned():
            item = self._kept.popleft() if self._kept else self._next()
            if item is None:
                if not self._asked:
                    self._ask()
                    self._asked = True
                yield None
                continue
            if isinstance(item, Stop):
                return
            if isinstance(item, Drop):
                raise Dropped  # the engine aborts the requests it holds (VllmEngine.run), the worker goes on
            self._asked = False
            yield item

    def urgent(self) -> Chunk | None:
        """An urgent chunk waiting in the queue (taken), else None; the rest stays for the stream, in order."""
        while (item := self._next()) is not None:
            if isinstance(item, Chunk) and item.urgent:
                self._asked = False  # it may be the answer to the engine's ask
                return item
            self._kept.append(item)
        return None

    def _next(self) -> Any:
        try:
            return self._tasks.get_nowait()
        except queue.Empty:
            return None

