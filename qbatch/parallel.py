"""Data parallel on one host: N independent engines, one process per GPU, one coordinator.

A 0.6B model fits on any GPU many times over, so scaling means more copies,
not a split model. This process stays the coordinator: it reads, plans,
writes parts, holds the lock and keeps the manifest, exactly as with one
engine; each worker process owns one vLLM engine (CUDA_VISIBLE_DEVICES=its
GPU) and pulls chunks. A worker that dies loses only its chunks in flight,
which go to the others. vLLM's own `LLM(data_parallel_size>1)` refuses to
start in one process, so qbatch does not use it.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from qbatch.engine import END, FEED_FACTOR, Chunk
from qbatch.errors import EngineError, ModelError
from qbatch.records import Completion
from qbatch.spec import EngineSpec

# Rows handed to a worker ahead of its engine: its own feed target (FEED_FACTOR x max_num_seqs) plus
# one chunk, so the engine never waits for the coordinator. Handing out by rows, not by a fixed number
# of chunks, keeps the engines evenly loaded, so they finish together (chunks of ~2,000 rows went 3:1).
POLL_S = 1.0
STARTUP_TIMEOUT_S = 1800.0
STOP = "stop"


@dataclass
class _Worker:
    rank: int
    device: str
    process: Any
    tasks: Any
    capacity: int = 1  # rows its engine keeps in flight
    outstanding: dict[int, Chunk] = field(default_factory=dict)

    @property
    def load(self) -> float:
        """Outstanding rows as a share of capacity: the least loaded worker gets the next chunk."""
        return sum(len(c.requests) for c in self.outstanding.values()) / self.capacity


class DataParallelEngine:
    """Implements the Engine protocol over N worker processes."""

    def __init__(self, spec: EngineSpec, model_path: str, max_model_len: int):
        devices = spec.gpus or [str(i) for i in range(spec.data_parallel_size)]
        context = mp.get_context("spawn")  # vLLM and CUDA do not survive fork
        self._results = context.Queue()
        worker_spec = replace(spec, data_parallel_size=1, gpus=None)
        self._workers: dict[int, _Worker] = {}
        for rank, device in enumerate(devices):
            tasks = context.Queue()
            process = context.Process(target=_worker_main, name=f"qbatch-dp-{rank}",
                                      args=(rank, len(devices), device, worker_spec, model_path, max_model_len,
                                            tasks, self._results))
            process.start()
            self._workers[rank] = _Worker(rank, device, process, tasks)
        atexit.register(self.close)
        self.max_num_seqs = self._wait_ready()

    def _wait_ready(self) -> int:
        ready: dict[int, int] = {}
        waited = 0.0
        while len(ready) < len(self._workers):
            try:
                message = self._results.get(timeout=POLL_S)
            except queue.Empty:
                waited += POLL_S
                dead = [w.rank for w in self._workers.values() if not w.process.is_alive() and w.rank not in ready]
                if dead or waited > STARTUP_TIMEOUT_S:
                    self.close()
                    raise ModelError(f"engine worker(s) {dead} exited while starting", hint="see the log above")
                continue
            if message[0] == "failed":
                self.close()
                raise ModelError(f"engine worker {message[1]} could not start: {message[2]}")
            ready[message[1]] = message[2]
            self._workers[message[1]].capacity = int(message[2] * FEED_FACTOR)
        return sum(ready.values())

    def run(self, chunks: Iterable[Chunk | None]) -> Iterator[tuple[Chunk, list[Completion]]]:
        source = iter(chunks)
        retry: deque[Chunk] = deque()
        exhausted = False
        while True:
            exhausted = self._hand_out(source, retry, exhausted)
            if exhausted and not retry and not any(w.outstanding for w in self._workers.values()):
                return
            try:
                message = self._results.get(timeout=POLL_S)
            except queue.Empty:
                self._reap(retry)
                continue
            if message[0] == "failed":
                raise EngineError(f"the engine failed in worker {message[1]}: {message[2]}",
                                  hint="finished parts are kept; rerun the same command to resume")
            _, rank, index, outputs = message
            worker = self._workers.get(rank)
            chunk = worker.outstanding.pop(index, None) if worker else None
            if chunk is not None:
                yield chunk, [Completion(request, *output) for request, output in zip(chunk.requests, outputs)]

    def _hand_out(self, source: Iterator[Chunk | None], retry: deque[Chunk], exhausted: bool) -> bool:
        """Give chunks to the least loaded worker until every worker has its capacity's worth."""
        while True:
            worker = min(self._workers.values(), key=lambda w: w.load)
            if worker.load >= 1:
                return exhausted
            chunk = retry.popleft() if retry else (END if exhausted else next(source, END))
            if chunk is END:
                return True
            if chunk is None:
                return exhausted
            worker.outstanding[chunk.index] = chunk
            worker.tasks.put(chunk)

    def _reap(self, retry: deque[Chunk]) -> None:
        """Give the chunks of dead workers to the living; fail when none is left."""
        for worker in [w for w in self._workers.values() if not w.process.is_alive()]:
            retry.extend(worker.outstanding.values())
            del self._workers[worker.rank]
            print(f"qbatch: engine worker {worker.rank} (device {worker.device}) died; "
                  f"{len(worker.outstanding)} chunks go to the others", flush=True)
        if not self._workers:
            raise EngineError("every engine worker died", hint="finished parts are kept; rerun to resume")

    def close(self) -> None:
        for worker in self._workers.values():
            if worker.process.is_alive():
                worker.tasks.put(STOP)
        for worker in self._workers.values():
            worker.process.join(timeout=30)
            if worker.process.is_alive():
                worker.process.kill()
        self._workers.clear()


def _worker_main(rank: int, world: int, device: str, spec: EngineSpec, model_path: str, max_model_len: int,
                 tasks: Any, results: Any) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = device
    try:
        import setproctitle

        setproctitle.setproctitle(f"qbatch::dp-worker-{rank}")
    except ImportError:
        pass
    from qbatch.engine import VllmEngine, _on_cpu

    try:
        if _on_cpu() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # CPU engines: each gets its own cores, or their OpenMP threads fight over all of them
            cores = sorted(os.sched_getaffinity(0))
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[rank::world] or cores))
        engine = VllmEngine(spec, model_path, max_model_len)
    except BaseException as exc:  # reported to the coordinator, which says so and stops
        results.put(("failed", rank, str(exc)))
        return
    results.put(("ready", rank, engine.max_num_seqs))
    try:
        for chunk, completions in engine.run(_feed(tasks)):
            outputs = [(c.text, c.finish_reason, c.num_completion_tokens, c.num_cached_tokens, c.error)
                       for c in completions]
            results.put(("done", rank, chunk.index, outputs))
    except BaseException as exc:
        results.put(("failed", rank, str(exc)))
    finally:
        engine.close()  # a multiprocessing child skips atexit: vLLM's engine process would outlive it


def _feed(tasks: Any) -> Iterator[Chunk | None]:
    """Chunks from the coordinator; None while none is waiting (the engine keeps generating)."""
    parent = os.getppid()
    while os.getppid() == parent:  # an orphaned worker (coordinator killed) stops
        try:
            item = tasks.get(timeout=0.005)
        except queue.Empty:
            yield None
            continue
        if item == STOP:
            return
        yield item
