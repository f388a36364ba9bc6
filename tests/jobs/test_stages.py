"""Pipeline stages in threads (qbatch/stages.py): order, errors, eager start, stopping."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from qbatch.jobs.stages import Stages


def _alive(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def test_items_pass_every_stage_in_order():
    with Stages(range(100), ("t-add", lambda x: x + 1), ("t-double", lambda x: x * 2)) as stages:
        assert list(stages) == [(x + 1) * 2 for x in range(100)]


def test_a_stage_error_reaches_the_consumer_and_the_threads_end():
    def explode(x: int) -> int:
        if x == 3:
            raise ValueError("row 3 is bad")
        return x

    stages = Stages(range(10), ("t-err-a", explode), ("t-err-b", lambda x: x))
    with pytest.raises(ValueError, match="row 3 is bad"):
        list(stages)
    time.sleep(0.5)
    assert _alive("t-err-") == []


def test_stages_start_at_once_and_close_stops_them():
    started = threading.Event()

    def source():
        for n in itertools.count():  # endless: only close() ends it
            started.set()
            yield n

    stages = Stages(source(), ("t-stop-a", lambda x: x), ("t-stop-b", lambda x: x))
    assert started.wait(5)  # filled before anyone asked
    assert next(stages) == 0
    stages.close()
    time.sleep(0.5)
    assert _alive("t-stop-") == []


def test_a_pipeline_can_wait_for_start():
    pulled = threading.Event()

    def source():
        pulled.set()
        yield 1

    stages = Stages(source(), ("t-later", lambda x: x), start=False)
    assert not pulled.wait(0.3)
    stages.start()
    stages.start()  # once only
    assert list(stages) == [1]
