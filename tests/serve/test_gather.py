"""serve/gather.py without a service: what the engines are handed when online rows ride beside a run."""

from __future__ import annotations

import threading

from qbatch.engines.base import Chunk, NullEngine
from qbatch.records import Request
from qbatch.serve.gather import SLICE_ROWS, Feeder, SharedEngine, Ticket


class Recording(NullEngine):
    """The null engine, noting each chunk it is handed."""

    def __init__(self):
        super().__init__()
        self.chunks: list[Chunk] = []

    def run(self, chunks):
        for chunk in chunks:
            if chunk is not None:
                self.chunks.append(chunk)
            yield from super().run([chunk])


def request(name: str) -> Request:
    return Request(name, 0, 0, [1, 2], {"max_tokens": 4}, None, {})


def test_online_chunks_go_to_the_engine_urgent_and_a_runs_slices_do_not():
    """A client waits on each online row (engines return them at their step: engines/base.py Chunk); a run's
    rows keep the engines' report period."""
    feeder = Feeder(None, ready=threading.Event(), failed=lambda: None)
    ticket = Ticket([request("online")])
    feeder._queue.append(ticket)  # queued, as submit() does, without starting the driver thread
    engine = Recording()
    run = Chunk(0, [request(f"r{i}") for i in range(SLICE_ROWS + 1)])
    back = [item for item in SharedEngine(engine, feeder).run([run]) if item is not None]
    assert [(c.index < 0, c.urgent, len(c.requests)) for c in engine.chunks] == \
        [(True, True, 1), (False, False, SLICE_ROWS), (False, False, 1)]
    assert ticket.future.result(0)[0].request.id == "online"
    assert sum(len(rows) for _, rows in back) == SLICE_ROWS + 1
