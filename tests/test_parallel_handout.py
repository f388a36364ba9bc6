"""The data-parallel coordinator hands chunks out by load (fast: no engines)."""

from __future__ import annotations

from collections import deque

from qbatch.engine import Chunk
from qbatch.parallel import DataParallelEngine, _Worker
from qbatch.spec import JobSpec


class Tasks(list):
    put = list.append


def coordinator(capacities: list[int]) -> DataParallelEngine:
    engine = object.__new__(DataParallelEngine)  # no worker processes
    engine._workers = {rank: _Worker(rank, str(rank), None, Tasks(), capacity=c) for rank, c in enumerate(capacities)}
    return engine


def chunks(sizes: list[int]):
    return iter([Chunk(i, [object()] * n) for i, n in enumerate(sizes)])


def test_chunks_go_to_the_least_loaded_worker_until_each_is_full():
    engine = coordinator([300, 300])
    source = chunks([100] * 10)
    exhausted = engine._hand_out(source, deque(), False)
    assert not exhausted
    handed = [[c.index for c in w.tasks] for w in engine._workers.values()]
    assert handed == [[0, 2, 4], [1, 3, 5]]  # alternating, 300 rows each, not 3 chunks to the first
    assert next(source).index == 6  # the rest waits for room


def test_a_worker_with_room_gets_the_next_chunk_and_the_end_is_reported():
    engine = coordinator([300, 300])
    source = chunks([100] * 7)
    engine._hand_out(source, deque(), False)
    engine._workers[1].outstanding.clear()  # worker 1 finished its chunks
    assert engine._hand_out(source, deque(), False) is True
    assert [c.index for c in engine._workers[1].tasks] == [1, 3, 5, 6]


def test_default_chunk_budget_is_split_among_engines():
    one = JobSpec.from_flat({})
    two = JobSpec.from_flat({"data_parallel_size": 2})
    gpus = JobSpec.from_flat({"gpus": ["0", "1", "2", "3"]})
    explicit = JobSpec.from_flat({"data_parallel_size": 2, "chunk_tokens": 5000})
    assert one.plan.chunk_tokens == 1_048_576
    assert two.plan.chunk_tokens == 1_048_576 // 8
    assert gpus.plan.chunk_tokens == 1_048_576 // 16
    assert explicit.plan.chunk_tokens == 5000
