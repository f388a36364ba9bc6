"""Data parallel on one host: N independent engines, one process per GPU, one coordinator.

A 0.6B model fits on any GPU many times over, so scaling means more copies,
not a split model. This process stays the coordinator (dispatch.py): it
reads, plans, writes parts, holds the lock and keeps the manifest, exactly as
with one engine; each worker process owns one vLLM engine
(CUDA_VISIBLE_DEVICES=its GPU) and pulls chunks. vLLM's own
`LLM(data_parallel_size>1)` refuses to start in one process, so qbatch does
not use it.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
from dataclasses import replace
from typing import Any

from qbatch.dispatch import POLL_S, STOP, Dispatcher, Message, Worker, feed, pack, start_engine
from qbatch.engine import Chunk
from qbatch.errors import ModelError
from qbatch.spec import EngineSpec

STARTUP_TIMEOUT_S = 1800.0


class DataParallelEngine(Dispatcher):
    """Implements the Engine protocol over N worker processes on this host."""

    def __init__(self, spec: EngineSpec, model_path: str, max_model_len: int):
        super().__init__()
        devices = spec.gpus or [str(i) for i in range(spec.data_parallel_size)]
        context = mp.get_context("spawn")  # vLLM and CUDA do not survive fork
        self._results = context.Queue()
        worker_spec = replace(spec, data_parallel_size=1, gpus=None)
        for rank, device in enumerate(devices):
            tasks = context.Queue()
            process = context.Process(target=_worker_main, name=f"qbatch-dp-{rank}",
                                      args=(rank, len(devices), device, worker_spec, model_path, max_model_len,
                                            tasks, self._results))
            process.start()
            self._workers[rank] = Worker(rank, f"worker {rank} (device {device})", (process, tasks))
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
                dead = [w.rank for w in self._workers.values() if not self._is_alive(w) and w.rank not in ready]
                if dead or waited > STARTUP_TIMEOUT_S:
                    self.close()
                    raise ModelError(f"engine worker(s) {dead} exited while starting", hint="see the log above")
                continue
            if message[0] == "failed":
                self.close()
                raise ModelError(f"engine worker {message[1]} could not start: {message[2]}")
            if message[0] == "want":  # a worker that is ready asks for work before the others are
                self._wanting.append(message[1])
                continue
            ready[message[1]] = message[2]
        return sum(ready.values())

    def _send(self, worker: Worker, chunk: Chunk) -> None:
        worker.handle[1].put(chunk)

    def _receive(self, timeout: float) -> Message | None:
        try:
            return self._results.get(timeout=timeout)
        except queue.Empty:
            return None

    def _is_alive(self, worker: Worker) -> bool:
        return worker.handle[0].is_alive()

    def close(self) -> None:
        for worker in self._workers.values():
            if self._is_alive(worker):
                worker.handle[1].put(STOP)
        for worker in self._workers.values():
            process = worker.handle[0]
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        self._workers.clear()


def _worker_main(rank: int, world: int, device: str, spec: EngineSpec, model_path: str, max_model_len: int,
                 tasks: Any, results: Any) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = device
    try:
        import setproctitle

        setproctitle.setproctitle(f"qbatch::dp-worker-{rank}")
    except ImportError:
        pass
    try:
        engine = start_engine(spec, model_path, max_model_len, rank, world)
    except BaseException as exc:  # reported to the coordinator, which says so and stops
        results.put(("failed", rank, str(exc)))
        return
    results.put(("ready", rank, engine.max_num_seqs))
    parent = os.getppid()
    try:
        chunks = feed(tasks, ask=lambda: results.put(("want", rank)), orphaned=lambda: os.getppid() != parent)
        for chunk, completions in engine.run(chunks):
            results.put(("done", rank, chunk.index, pack(completions)))
    except BaseException as exc:
        results.put(("failed", rank, str(exc)))
    finally:
        engine.close()  # a multiprocessing child skips atexit: vLLM's engine process would outlive it
