"""The coordinator core shared by --data-parallel-size and --backend ray, with in-process workers:
every chunk comes back exactly once, whichever worker dies or answers late."""

from __future__ import annotations

import re
from collections import deque

import pytest

from qbatch.engines.base import Chunk, NullEngine
from qbatch.engines.dispatch import Dispatcher, Worker
from qbatch.engines.messages import Failed, Finished, Ready, Stop, Want, pack
from qbatch.errors import EngineError
from qbatch.records import Request


class InProcessWorkers(Dispatcher):
    """Workers that ask for chunks while they hold fewer than `room`, and answer in turn;
    `dying` vanishes once it holds 2 chunks, and answers them after all."""

    def __init__(self, num_workers: int, dying: int | None = None, failing: int | None = None,
                 room: dict[int, int] | None = None):
        super().__init__()
        self.inbox = {rank: deque() for rank in range(num_workers)}
        self.dying, self.failing, self.dead, self.asked = dying, failing, set(), set()
        self.room = room or {}
        self.received = {rank: [] for rank in range(num_workers)}
        for rank in range(num_workers):
            self._workers[rank] = Worker(rank, f"worker {rank}", None)

    def _send(self, worker, chunk):
        self.inbox[worker.rank].append(chunk)
        self.received[worker.rank].append(chunk.index)
        self.asked.discard(worker.rank)
        if worker.rank == self.dying and len(self.inbox[worker.rank]) == 2:
            self.dead.add(worker.rank)

    def _receive(self, timeout):
        for rank, inbox in self.inbox.items():
            if rank not in self.dead | self.asked | self._starting and len(inbox) < self.room.get(rank, 2):
                self.asked.add(rank)
                return Want(rank)
        reaped = [rank for rank in self.inbox if rank in self.dead and rank not in self._workers]
        for rank in reaped + [rank for rank in self.inbox if rank not in self.dead]:  # late answers first
            inbox = self.inbox[rank]
            if inbox:
                chunk = inbox.popleft()
                if rank == self.failing:
                    return Failed(rank, "engine core died")
                _, completions = next(NullEngine().run([chunk]))
                return Finished(rank, chunk.index, list(range(len(completions))), pack(completions))
        return None

    def _is_alive(self, worker):
        return worker.rank not in self.dead


def messages(caplog) -> list[tuple[str, str]]:
    return [(record.levelname, record.getMessage()) for record in caplog.records]


def rows_back(run) -> list:
    """What a run yields, without the ticks it yields while no row comes back."""
    return [item for item in run if item is not None]


def make_chunks(count: int, rows: int = 2) -> list[Chunk]:
    return [Chunk(c, [Request(f"c{c}r{r}", 0, c * rows + r, [1, 2, 3], {"max_tokens": 4}, None, {"keep": "x"})
                      for r in range(rows)]) for c in range(count)]


def test_a_dead_workers_chunks_go_to_the_others_once(engine_log):
    results = rows_back(InProcessWorkers(3, dying=1).run(make_chunks(20)))
    assert sorted(chunk.index for chunk, _ in results) == list(range(20))  # each once, the late answer ignored
    for chunk, completions in results:
        assert [c.request.id for c in completions] == [r.id for r in chunk.requests]
        assert completions[0].request.extra == {"keep": "x"}  # the coordinator's requests, not the slim copies
    assert ("WARNING", "engine worker 1 died; its 4 rows in flight (2 chunks) go to the others") in messages(engine_log)


def test_an_engine_failure_or_no_worker_left_stops_the_run():
    with pytest.raises(EngineError, match=r"^the engine failed in worker 0: engine core died$"):
        rows_back(InProcessWorkers(1, failing=0).run(make_chunks(4)))
    with pytest.raises(EngineError, match="every engine worker died"):
        rows_back(InProcessWorkers(1, dying=0).run(make_chunks(4)))


class LateWorkers(InProcessWorkers):
    """Worker 0 runs from the start; worker 1's engine is ready a few messages later, worker 2's never starts."""

    def __init__(self):
        super().__init__(3)
        self._starting = {1, 2}
        self.messages = 0

    def _receive(self, timeout):
        self.messages += 1
        if self.messages == 3:
            return Failed(2, "CUDA out of memory")
        if self.messages == 6:
            return Ready(1, 8)
        return super()._receive(timeout)


def test_engines_join_when_ready_and_one_that_cannot_start_is_left_out(engine_log):
    workers = LateWorkers()
    results = rows_back(workers.run(make_chunks(20)))
    assert sorted(chunk.index for chunk, _ in results) == list(range(20))
    assert workers.received[0][:2] == [0, 1] and workers.received[1] and not workers.received[2]
    assert any(level == "INFO" and re.fullmatch(r"engine worker 1 ready \d+\.\ds after the engines started, joins the run",
                                                 text) for level, text in messages(engine_log))
    assert ("WARNING", "engine worker 2 could not start, the run goes on without it: CUDA out of memory") \
        in messages(engine_log)


def test_a_worker_that_dies_while_the_others_talk_is_noticed(monkeypatch, engine_log):
    """Dead workers are looked for every POLL_S even when messages never stop (4 busy engines)."""
    from qbatch.engines import dispatch

    monkeypatch.setattr(dispatch, "POLL_S", 0.0)
    workers = InProcessWorkers(3)
    workers._starting = {2}
    workers.dead.add(2)  # killed while its engine was starting: it never says anything
    assert sorted(chunk.index for chunk, _ in rows_back(workers.run(make_chunks(10)))) == list(range(10))
    assert ("WARNING", "engine worker 2 died; its 0 rows in flight (0 chunks) go to the others") in messages(engine_log)
    assert workers._starting == set()


def test_wait_started_returns_once_every_engine_started_or_failed():
    workers = LateWorkers()
    workers.wait_started()
    assert workers._starting == set() and set(workers._workers) == {0, 1}
    assert sorted(chunk.index for chunk, _ in rows_back(workers.run(make_chunks(6)))) == list(range(6))


def test_a_running_engine_that_fails_still_stops_the_run():
    workers = LateWorkers()
    workers._starting = set()  # all running: a failure is not a start failure
    with pytest.raises(EngineError, match="the engine failed in worker 2: CUDA out of memory"):
        rows_back(workers.run(make_chunks(20)))


def test_chunks_go_only_to_workers_that_ask():
    """A worker whose engine is full never asks, so it is never handed chunks to sit on."""
    workers = InProcessWorkers(2, room={0: 2, 1: 0})
    results = rows_back(workers.run(make_chunks(10)))
    assert sorted(chunk.index for chunk, _ in results) == list(range(10))
    assert workers.received == {0: list(range(10)), 1: []}


def test_feed_asks_once_until_a_chunk_comes():
    import queue

    from qbatch.engines.dispatch import Feed

    tasks, asks = queue.Queue(), []
    chunks = iter(Feed(tasks, ask=lambda: asks.append(1)))
    assert next(chunks) is None and next(chunks) is None
    assert len(asks) == 1  # asked once, not at every engine step
    tasks.put("chunk")
    assert next(chunks) == "chunk"
    assert next(chunks) is None and len(asks) == 2  # room again: asks again
    tasks.put(Stop())
    assert list(chunks) == []


def test_an_urgent_chunk_jumps_what_waits_in_a_workers_queue():
    """An engine with no room takes only urgent chunks (its door); what else came stays, in order, for when it
    has room again, and an urgent chunk that answered the engine's ask lets it ask again."""
    import queue

    from qbatch.engines.dispatch import Feed

    tasks, asks = queue.Queue(), []
    stream = Feed(tasks, ask=lambda: asks.append(1))
    chunks = iter(stream)
    assert next(chunks) is None and len(asks) == 1
    batch, online, later = Chunk(0, []), Chunk(-1, [], urgent=True), Chunk(1, [])
    for item in (batch, online, later, Stop()):
        tasks.put(item)
    assert stream.urgent() is online and stream.urgent() is None
    assert next(chunks) is batch and next(chunks) is later and list(chunks) == []


def test_the_coordinator_hands_an_urgent_chunk_to_a_worker_that_did_not_ask():
    """Engines full of a batch's rows do not ask for more; an online chunk (urgent, from the run's stream's
    door) goes at once to the running engine holding the fewest rows, not when one next asks."""
    from qbatch.engines.base import Stream

    workers = InProcessWorkers(2, room={0: 0, 1: 0})  # neither ever asks
    online = deque(Chunk(-1 - c, chunk.requests, urgent=True) for c, chunk in enumerate(make_chunks(2)))
    run = workers.run(Stream([], lambda: online.popleft() if online else None))
    back = [next(item for item in run if item is not None) for _ in range(2)]
    run.close()  # (these workers never ask, so the run would never learn that its stream ended)
    assert sorted(chunk.index for chunk, _ in back) == [-2, -1]
    assert workers.received == {0: [0], 1: [1]}  # the second to the other engine: the first held 2 rows


class SlowSecondEngine(InProcessWorkers):
    """Worker 0's engine has room for many chunks; worker 1's is ready after 12 messages. Engines run 4 rows at once."""

    def __init__(self):
        super().__init__(2, room={0: 10})
        self.engine_seqs = 4
        self._starting = {1}
        self.messages = 0
        self.held = {"starting": 0, "running": 0}  # the most rows worker 0 held while worker 1 started / ran

    def _send(self, worker, chunk):
        super()._send(worker, chunk)
        if worker.rank == 0:
            phase = "starting" if self._starting else "running"
            self.held[phase] = max(self.held[phase], sum(h.num_left for h in worker.outstanding.values()))

    def _receive(self, timeout):
        self.messages += 1
        return Ready(1, 4) if self.messages == 12 else super()._receive(timeout)


def test_while_an_engine_starts_the_others_hold_no_more_rows_than_they_run():
    workers = SlowSecondEngine()
    results = rows_back(workers.run(make_chunks(30)))  # chunks of 2 rows
    assert sorted(chunk.index for chunk, _ in results) == list(range(30))
    assert workers.held["starting"] == 4  # two chunks, though its engine asked for more
    assert workers.held["running"] > 4 and workers.received[1]  # then the cap is gone, and worker 1 takes its share


class RecordingDrops(InProcessWorkers):
    """Workers that, like Ray actors, finish the chunks of a run that stopped early (their late answers
    come first in the next run); the coordinator's drops are recorded."""

    def __init__(self, num_workers: int):
        super().__init__(num_workers, room={rank: 4 for rank in range(num_workers)})
        self.drops = []

    def _drop(self, worker):
        self.drops.append(worker.rank)


def make_run(count: int, tokens: int) -> list[Chunk]:
    return [Chunk(c, [Request(f"t{tokens}c{c}r{r}", 0, c * 2 + r, [7] * tokens, {"max_tokens": 4}, None, {})
                      for r in range(2)]) for c in range(count)]


def test_a_run_that_stopped_early_never_answers_for_the_next_one():
    """Warm engines (a Session, `qbatch serve`) outlive a run that stops early (Ctrl-C, a cancelled
    batch): the chunks its workers held are dropped, and their late answers, numbered as they
    travelled, are never taken for the next run's chunks of the same index."""
    workers = RecordingDrops(2)
    first = workers.run(make_run(10, tokens=3))
    next(first)
    first.close()  # the consumer stopped: chunks are still out with both workers
    assert sorted(workers.drops) == [0, 1]
    assert not any(w.outstanding for w in workers._workers.values())
    workers.room = {0: 12, 1: 12}  # the next run's chunks all go out before the stale answers come
    results = rows_back(workers.run(make_run(6, tokens=5)))
    assert sorted(chunk.index for chunk, _ in results) == list(range(6))
    for chunk, completions in results:
        assert [c.request.id for c in completions] == [r.id for r in chunk.requests]
        assert {c.text for c in completions} == {"[null engine: 5 prompt tokens]"}  # this run's outputs only


def test_a_worker_told_to_drop_its_chunks_takes_the_next_runs():
    """A worker process told to Drop aborts what its engine holds (its engine.run ends) and goes on with
    the chunks that follow, until Stop."""
    import queue

    from qbatch.engines.messages import Drop
    from qbatch.engines.processes import _serve_chunks

    class Results(list):
        put = list.append

    tasks, results = queue.Queue(), Results()
    for item in (*make_run(1, tokens=3), Drop(), Chunk(7, make_run(1, tokens=5)[0].requests), Stop()):
        tasks.put(item)
    _serve_chunks(NullEngine(), 0, tasks, results, orphaned=lambda: False)
    done = [m for m in results if isinstance(m, Finished)]
    assert [m.chunk_index for m in done] == [0, 7]
    assert done[1].outputs[0].text == "[null engine: 5 prompt tokens]"


class AnsweringInPieces(InProcessWorkers):
    """Workers that answer a chunk in two pieces, its first row and then the rest (as engines send rows
    back as they finish); worker 0 dies right after its first piece, its chunks' other rows unanswered."""

    def __init__(self):
        super().__init__(2)
        self.second_pieces: deque = deque()
        self.sent_ids = {0: [], 1: []}

    def _send(self, worker, chunk):
        super()._send(worker, chunk)
        self.sent_ids[worker.rank] += [r.id for r in chunk.requests]

    def _receive(self, timeout):
        if self.second_pieces:
            return self.second_pieces.popleft()
        message = super()._receive(timeout)
        if isinstance(message, Finished) and len(message.positions) > 1:
            if message.rank == 0:
                self.dead.add(0)
            else:
                self.second_pieces.append(Finished(message.rank, message.chunk_index, message.positions[1:],
                                                   message.outputs[1:]))
            return Finished(message.rank, message.chunk_index, message.positions[:1], message.outputs[:1])
        return message


def test_a_chunks_rows_come_back_in_pieces_and_a_dead_workers_unanswered_rows_alone_are_redone(engine_log):
    workers = AnsweringInPieces()
    chunks = make_chunks(8, rows=3)
    results = rows_back(workers.run(chunks))
    ids = [c.request.id for _, completions in results for c in completions]
    assert sorted(ids) == sorted(r.id for chunk in chunks for r in chunk.requests)  # each row once
    for chunk, completions in results:
        assert all(c.request.id.startswith(f"c{chunk.index}r") for c in completions)
        assert completions[0].request.extra == {"keep": "x"}  # the coordinator's requests
    # worker 0 answered the first row of its first chunk: only that chunk's other rows, and its other
    # chunk whole, went to worker 1
    assert workers.sent_ids[1].count("c0r0") == 0 and {"c0r1", "c0r2", "c1r0"} <= set(workers.sent_ids[1])
    assert ("WARNING", "engine worker 0 died; its 5 rows in flight (2 chunks) go to the others") in messages(engine_log)


def test_a_worker_sends_its_engines_rows_as_they_finish_named_by_position():
    from qbatch.engines.processes import _serve_chunks

    class Pieces(NullEngine):
        """Hands a chunk's rows back out of order, one at a time, with a tick between."""

        def run(self, chunks):
            for chunk in chunks:
                if chunk is None:
                    continue
                completions = [self._complete(r) for r in chunk.requests]
                for pos in (2, 0, 1):
                    yield None
                    yield chunk, [completions[pos]]

    class Results(list):
        put = list.append

    import queue

    tasks, results = queue.Queue(), Results()
    chunk = make_chunks(1, rows=3)[0]
    tasks.put(Chunk(5, [r for r in chunk.requests]))
    tasks.put(Stop())
    _serve_chunks(Pieces(), 0, tasks, results, orphaned=lambda: False)
    finished = [m for m in results if isinstance(m, Finished)]
    assert [(m.chunk_index, m.positions) for m in finished] == [(5, [2]), (5, [0]), (5, [1])]


def test_the_coordinator_ticks_while_no_row_comes_back(monkeypatch):
    from qbatch.engines import dispatch

    monkeypatch.setattr(dispatch, "REPORT_S", 0.0)
    items = list(InProcessWorkers(2).run(make_chunks(4)))
    assert None in items and sorted(item[0].index for item in items if item is not None) == [0, 1, 2, 3]


def test_a_ray_actor_sends_rows_back_as_they_finish_and_counts_a_chunk_done_with_its_last():
    """EngineActor's loop, without Ray: an engine that hands a chunk's rows back in two pieces."""
    import threading
    import time

    from qbatch.engines.ray_actors import EngineActor

    class Halves(NullEngine):
        def sample(self):
            return None

        def run(self, chunks):
            for chunk in chunks:
                if chunk is not None:
                    completions = [self._complete(r) for r in chunk.requests]
                    yield chunk, completions[:1]
                    yield None
                    yield chunk, completions[1:]

    actor = EngineActor(None)
    actor._engine = Halves()
    actor._thread = threading.Thread(target=actor._generate, daemon=True)
    actor._thread.start()
    actor.submit(Chunk(3, make_chunks(1, rows=3)[0].requests))
    finished, deadline = [], time.monotonic() + 10
    while len(finished) < 2 and time.monotonic() < deadline:
        finished += [m for m in actor.events() if isinstance(m, Finished)]
    assert [(m.chunk_index, m.positions) for m in finished] == [(3, [0]), (3, [1, 2])]
    assert actor._open == 0
    actor._tasks.put(Stop())
    actor._thread.join(timeout=10)


class Recorded(InProcessWorkers):
    """One worker; what the coordinator waits for each message, and whether each chunk came to it urgent."""

    def __init__(self):
        super().__init__(1)
        self.waits, self.urgent = [], []

    def _send(self, worker, chunk):
        self.urgent.append(chunk.urgent)
        super()._send(worker, chunk)

    def _receive(self, timeout):
        self.waits.append(timeout)
        return super()._receive(timeout)


def test_a_live_feed_is_asked_again_within_ms_and_its_urgent_chunks_stay_urgent():
    """serve's online queue: while a worker waits for work and the source has none ready, the coordinator
    asks the source again after LIVE_POLL_S, not once some worker next speaks (up to POLL_S, which a request
    arriving then waited); an online chunk reaches its worker urgent (slim keeps the mark)."""
    from qbatch.engines.dispatch import LIVE_POLL_S, POLL_S

    online = Chunk(-1, make_chunks(1)[0].requests, urgent=True)

    def source():
        yield None
        yield None
        yield online

    workers = Recorded()
    assert [chunk for chunk, _ in rows_back(workers.run(source()))] == [online]
    assert workers.waits[:3] == [POLL_S, LIVE_POLL_S, LIVE_POLL_S] and set(workers.waits[3:]) == {POLL_S}
    assert workers.urgent == [True]
