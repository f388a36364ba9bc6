"""Dynamic batching: online requests gathered and fed to the warm engines, beside the batches.

An engine takes one stream of chunks at a time (engines/base.py), and a run's stream is the runner's.
So whoever drives the engine feeds the online requests too:
- a batch or a `run --server` job running: its stream is merged with the online queue (`SharedEngine`).
  Each time the engine takes work, everything online that is queued goes in as one chunk before the
  run's next slice (SLICE_ROWS rows of its chunk), and that slice right after it: online first, and
  the run moves at every step, never starved. While the run's last rows finish, online rows still go in beside them.
- nothing else running: a driver thread runs the engine on the online queue alone, gathering what
  arrives within `GATHER_S` (or whatever queued while the engine was busy) into one chunk. A run that
  wants the engine asks for it (`turn`): the driver takes no more online chunks, the rows it has out
  finish, and it hands the engine over; the online queue then rides in the run's stream.
Online chunks are urgent (engines/base.py Chunk): an engine returns their rows at the step they finish,
not at its report period (REPORT_S), and a coordinator of several engines looks at the online queue again
within LIVE_POLL_S (engines/dispatch.py), not when a worker next speaks: a client's answer, and so its next
request, waits for neither.
An engine takes a run's next chunk only while it has room (its requests in flight under their cap), which a
large batch fills for the time its first rows take; the online queue is also the run's stream's urgent door
(engines/base.py Stream), through which an engine takes online rows at its next step, room or not, making
them places among its running rows (engines/vllm.py `_make_room`: vLLM admits nothing, whatever its
priority, while all are taken), and a coordinator hands them to an engine that did not ask. Online latency
is therefore bounded by the engine's step and, in a run, by one slice's rows going in before the next pull:
never by the run's length. Online chunks carry negative indexes; the runner never sees them (a None tick
instead).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from qbatch.engines.base import Chunk, FinishedRows, Stream
from qbatch.engines.config import EngineConfig
from qbatch.engines.pool import EnginePool
from qbatch.errors import EngineError, first_line
from qbatch.log import log
from qbatch.records import Completion, Embedding, Request

GATHER_S = 0.005  # how long the idle driver waits for more requests once one arrived: a few ms of latency
SLICE_ROWS = 64  # a run's chunk goes to the engine in slices of this many rows, online rows between them
STATS_LOG_S = 60.0  # the online counts go to the service's log at most this often
SLICE_INDEX = 1 << 40  # slices' own chunk indexes start here: above any run's, apart from online ones (< 0)


@dataclass(eq=False)
class Ticket:
    """One online request's rows (one Request, n samples inside), and the future its route awaits."""

    requests: list[Request]
    future: Future[list[Any]] = field(default_factory=Future)  # its Completions (Embeddings for an embedding request)
    completions: dict[str, Completion | Embedding] = field(default_factory=dict)
    cancelled: bool = False  # the client went away: its rows not yet in an engine never go

    def missing(self) -> list[Request]:
        return [r for r in self.requests if r.id not in self.completions]

    def add(self, completion: Completion | Embedding) -> None:
        self.completions[completion.request.id] = completion
        if not self.missing() and not self.future.done():
            self.future.set_result([self.completions[r.id] for r in self.requests])

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


@dataclass
class OnlineStats:
    """What the online side has done, for the service's log and /health."""

    requests: int = 0  # online requests answered
    gathers: int = 0  # chunks of them handed to an engine
    largest: int = 0  # the most requests in one chunk
    in_runs: int = 0  # chunks that rode in a batch's or a job's stream


class Feeder:
    """The online queue, who drives the engine (`turn`), and the driver thread for when no run does."""

    def __init__(self, pool: EnginePool, *, ready: threading.Event, failed: Callable[[], str | None]):
        self.pool = pool
        self.ready, self.failed = ready, failed
        self.config: EngineConfig | None = None  # the generation engine runs got last: the one online rows use
        self.stats = OnlineStats()
        self._turn = threading.Lock()  # held by whoever drives the engines
        self._wanting = 0  # runs waiting for the turn
        self._lock = threading.Lock()  # the queue and the rows out
        self._queue: deque[Ticket] = deque()
        self._arrived = threading.Event()
        self._out: dict[int, dict[str, Ticket]] = {}  # online chunk index -> its rows' request ids -> ticket
        self._next_index = -1
        self._driver: threading.Thread | None = None
        self._logged_at = time.monotonic()

    # -- the routes' side ------------------------------------------------------------
    def submit(self, ticket: Ticket) -> None:
        with self._lock:
            self._queue.append(ticket)
            self._arrived.set()
            if self._driver is None:
                self._driver = threading.Thread(target=self._drive, name="qbatch-serve-online", daemon=True)
                self._driver.start()

    # -- a run's side ----------------------------------------------------------------
    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """The engines for a run (or the pool's upkeep): the driver hands them over once its rows are in."""
        with self._lock:
            self._wanting += 1
        self._arrived.set()  # an idle driver looks now
        try:
            self._turn.acquire()
        finally:
            with self._lock:
                self._wanting -= 1
        try:
            yield
        finally:
            self._turn.release()

    def merged(self, chunks: Iterable[Chunk], taken: list[int], batch_rows: list[int]) -> Stream:
        """A run's chunks with the online queue's before each; then, while the run's rows are out (`batch_rows`),
        online chunks beside them (None: nothing new, keep generating). The online queue is also the stream's
        urgent door (base.Stream): an engine whose requests in flight are at their cap takes it still."""

        def beside() -> Chunk | None:
            online = self._take()
            if online is not None:
                taken.append(online.index)
                self.stats.in_runs += 1
            return online

        def stream() -> Iterator[Chunk | None]:
            for chunk in chunks:
                online = beside()
                if online is not None:
                    yield online
                batch_rows[0] += len(chunk.requests)
                yield chunk
            while batch_rows[0] > 0:
                yield beside()

        return Stream(stream(), beside)

    def deliver(self, chunk: Chunk, completions: FinishedRows) -> None:
        with self._lock:
            tickets = self._out.get(chunk.index, {})
            for completion in completions:
                ticket = tickets.pop(completion.request.id, None)
                if ticket is not None:
                    ticket.add(completion)
                    if ticket.future.done():
                        self.stats.requests += 1
            if not tickets:
                self._out.pop(chunk.index, None)

    def requeue(self, taken: list[int]) -> None:
        """Online chunks a stopped run took and did not finish: their requests go first again."""
        with self._lock:
            tickets = {id(t): t for index in taken for t in self._out.pop(index, {}).values()}
            for ticket in tickets.values():
                if not ticket.future.done():
                    self._queue.appendleft(ticket)
            if tickets:
                self._arrived.set()

    def fail_out(self, taken: list[int], exc: BaseException) -> None:
        with self._lock:
            for index in taken:
                for ticket in self._out.pop(index, {}).values():
                    ticket.fail(exc)

    # -- internals -----------------------------------------------------------------------
    def _take(self) -> Chunk | None:
        """Every queued request as one chunk (their rows registered as out), or None."""
        with self._lock:
            tickets = [t for t in self._queue if not t.cancelled]
            self._queue.clear()
            self._arrived.clear()
            if not tickets:
                return None
            index, self._next_index = self._next_index, self._next_index - 1
            requests = [r for t in tickets for r in t.missing()]
            self._out[index] = {r.id: t for t in tickets for r in t.missing()}
            self.stats.gathers += 1
            self.stats.largest = max(self.stats.largest, len(tickets))
            self._log_stats()
            return Chunk(index, requests, urgent=True)  # a client waits on each row

    def _log_stats(self) -> None:
        """At most every STATS_LOG_S, as online chunks go in: what the online side has done."""
        now = time.monotonic()
        if now - self._logged_at < STATS_LOG_S:
            return
        self._logged_at = now
        stats = self.stats
        log.info(f"serve: online: {stats.requests:,} requests answered, {stats.gathers:,} chunks (largest "
                 f"{stats.largest}), {stats.in_runs:,} of them beside a batch or job")

    def _rows_out(self) -> bool:
        with self._lock:
            return any(self._out.values())

    def _drive(self) -> None:
        """The driver: whenever requests wait and no run has the engine, run it on the online queue."""
        while True:
            self._arrived.wait()
            if not self.ready.is_set():
                self._wait_ready()
                continue
            time.sleep(GATHER_S)  # gather what arrives meanwhile
            with self._turn:
                taken: list[int] = []
                try:
                    self._drive_once(taken)
                except BaseException as exc:  # noqa: BLE001 - the requests fail; the driver keeps serving
                    log.error(f"serve: online requests failed: {first_line(exc)}")
                    self.fail_out(taken, exc)
            if self._wanting:
                time.sleep(0.001)  # a run waits for the turn: let it take it first

    def _wait_ready(self) -> None:
        """Before the engines are warm: wait for them, or fail what is queued when they did not start."""
        while not self.ready.wait(0.5):
            reason = self.failed()
            if reason:
                with self._lock:
                    queued, self._queue = list(self._queue), deque()
                    self._arrived.clear()
                for ticket in queued:
                    ticket.fail(EngineError(f"the service's engines did not start ({reason})"))
                return

    def _drive_once(self, taken: list[int]) -> None:
        with self._lock:
            if not self._queue or self.config is None:
                self._arrived.clear()
                return
        engine = self.pool.get(self.config)
        for item in engine.run(self._online_only(taken)):
            if item is not None:
                self.deliver(*item)

    def _online_only(self, taken: list[int]) -> Iterator[Chunk | None]:
        """The online queue as a stream, until it is empty with no rows out, or a run wants the engine."""
        while not self._wanting:
            online = self._take()
            if online is not None:
                taken.append(online.index)
                yield online
                continue
            if not self._rows_out():
                return
            yield None  # rows out, nothing new: the engine steps


class SharedEngine:
    """A run's engine: its stream merged with the online queue (Feeder.merged), the online rows sent to
    their requests, everything else the engine's own."""

    def __init__(self, engine: Any, feeder: Feeder):
        self.engine, self.feeder = engine, feeder

    def run(self, chunks: Iterable[Chunk | None]) -> Iterator[tuple[Chunk, list[Any]] | None]:
        feeder = self.feeder
        taken: list[int] = []
        batch_rows = [0]
        parents: dict[int, Chunk] = {}  # a slice's index -> the run's chunk it is part of
        with feeder.turn():
            try:
                for item in self.engine.run(feeder.merged(_sliced(chunks, parents), taken, batch_rows)):
                    if item is None or item[0].index >= 0:
                        if item is not None:
                            batch_rows[0] -= len(item[1])
                            item = (parents.get(item[0].index, item[0]), item[1])
                        yield item
                        continue
                    feeder.deliver(*item)
                    yield None  # the run's clock
            finally:
                feeder.requeue(taken)  # a run stopped early: its online rows go to the next driver

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def _sliced(chunks: Iterable[Chunk | None], parents: dict[int, Chunk]) -> Iterator[Chunk]:
    """A run's chunks in slices of at most SLICE_ROWS rows, each with an index of its own (its rows come back
    under the run's chunk): an engine takes the next chunk only once it has added the last one's rows, so
    online rows wait behind one slice, not behind a whole chunk (thousands of rows in a large batch)."""
    next_index = SLICE_INDEX
    for chunk in chunks:
        if chunk is None:  # a run's stream waits for nothing: its chunks are all there
            continue
        if len(chunk.requests) <= SLICE_ROWS:
            yield chunk
            continue
        for start in range(0, len(chunk.requests), SLICE_ROWS):
            parents[next_index] = chunk
            yield Chunk(next_index, chunk.requests[start:start + SLICE_ROWS])
            next_index += 1


class SharedPool:
    """The service's pool as its runs see it: an engine comes wrapped (SharedEngine) with the feeder of its
    task (generation, embedding: engines of their own), and the pool's upkeep between runs (drop_dead aborts
    what an engine holds) waits for the online rows out."""

    def __init__(self, pool: EnginePool, feeders: dict[str, Feeder]):
        self.pool, self.feeders = pool, feeders  # by the engine's task: "generate", "embed"

    def get(self, config: EngineConfig) -> Any:
        engine = self.pool.get(config)
        feeder = self.feeders[config.task]
        feeder.config = config
        return SharedEngine(engine, feeder)

    def drop_dead(self) -> None:
        with contextlib.ExitStack() as stack:
            for feeder in self.feeders.values():
                stack.enter_context(feeder.turn())
            self.pool.drop_dead()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)
