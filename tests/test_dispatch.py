"""The coordinator core shared by --data-parallel-size and --backend ray, with in-process workers:
every chunk comes back exactly once, whichever worker dies or answers late."""

from __future__ import annotations

from collections import deque

import pytest

from qbatch.dispatch import Dispatcher, Worker, pack
from qbatch.engine import Chunk, NullEngine
from qbatch.errors import EngineError
from qbatch.records import Request


class InProcessWorkers(Dispatcher):
    """Workers that answer in turn; `dying` vanishes once it holds 3 chunks, and answers them after all."""

    def __init__(self, num_workers: int, dying: int | None = None, failing: int | None = None):
        super().__init__()
        self.max_num_seqs = 8
        self.inbox = {rank: deque() for rank in range(num_workers)}
        self.dying, self.failing, self.dead = dying, failing, set()
        for rank in range(num_workers):
            self._workers[rank] = Worker(rank, f"worker {rank}", None)

    def _send(self, worker, chunk):
        self.inbox[worker.rank].append(chunk)
        if worker.rank == self.dying and len(self.inbox[worker.rank]) == 3:
            self.dead.add(worker.rank)

    def _receive(self, timeout):
        reaped = [rank for rank in self.inbox if rank in self.dead and rank not in self._workers]
        for rank in reaped + [rank for rank in self.inbox if rank not in self.dead]:  # late answers first
            inbox = self.inbox[rank]
            if inbox:
                chunk = inbox.popleft()
                if rank == self.failing:
                    return "failed", rank, "engine core died"
                _, completions = next(NullEngine().run([chunk]))
                return "done", rank, chunk.index, pack(completions)
        return None

    def _is_alive(self, worker):
        return worker.rank not in self.dead


def make_chunks(count: int, rows: int = 2) -> list[Chunk]:
    return [Chunk(c, [Request(f"c{c}r{r}", 0, c * rows + r, [1, 2, 3], {"max_tokens": 4}, None, {"keep": "x"})
                      for r in range(rows)]) for c in range(count)]


def test_a_dead_workers_chunks_go_to_the_others_once(capsys):
    results = list(InProcessWorkers(3, dying=1).run(make_chunks(20)))
    assert sorted(chunk.index for chunk, _ in results) == list(range(20))  # each once, the late answer ignored
    for chunk, completions in results:
        assert [c.request.id for c in completions] == [r.id for r in chunk.requests]
        assert completions[0].request.extra == {"keep": "x"}  # the coordinator's requests, not the slim copies
    assert "qbatch: engine worker 1 died; 3 chunks go to the others" in capsys.readouterr().out


def test_an_engine_failure_or_no_worker_left_stops_the_run():
    with pytest.raises(EngineError, match=r"^the engine failed in worker 0: engine core died$"):
        list(InProcessWorkers(1, failing=0).run(make_chunks(4)))
    with pytest.raises(EngineError, match="every engine worker died"):
        list(InProcessWorkers(1, dying=0).run(make_chunks(4)))
