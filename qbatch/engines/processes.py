"""Data parallel on one host: independent engines, one process each, one or more per GPU, one coordinator.

A 0.6B model fits on any GPU many times over, so scaling means more copies,
not a split model. This process stays the coordinator (dispatch.py): it
reads, plans, writes parts, holds the lock and keeps the manifest, exactly as
with one engine; each worker process owns one vLLM engine
(CUDA_VISIBLE_DEVICES=its GPU) and pulls chunks. vLLM's own
`LLM(data_parallel_size>1)` refuses to start in one process, so qbatch does
not use it.

A small model leaves its GPU idle for part of each step while vLLM's engine
loop runs on the CPU, so by default such a model gets two engines per GPU
(placement.py), each with half of the GPU's memory. Engines sharing a GPU
start at once when their KV cache is fixed: by qbatch unless the user set
--gpu-memory-utilization (qbatch/plan/placement.py), or by
--kv-cache-memory-bytes; vLLM then measures nothing (EngineConfig.start_together).
Each engine's share of its GPU's memory is in its LLM(...) arguments (qbatch/plan/). When vLLM sizes it by
profiling, they start one after another: it counts the memory that changed
while it profiled, and a neighbour starting meanwhile would count as its own
(a running one keeps its memory). The coordinator logs each engine's ready
time from the engines' start. The run starts as soon as one engine is ready;
the others join when they are, and one that fails to start then is left out
with a warning (the run goes on with the rest).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qbatch.engines import mps
from qbatch.engines.base import STARTUP_TIMEOUT_S, Chunk
from qbatch.engines.config import EngineConfig
from qbatch.engines.dispatch import POLL_S, Answers, Dispatcher, Dropped, Feed, Worker, send_stats, start_engine
from qbatch.engines.messages import Drop, Failed, Message, Ready, Stop, Want
from qbatch.engines.vllm_output import engine_processes, enter_engine_process
from qbatch.errors import ModelError, QbatchError, first_line
from qbatch.log import log
from qbatch.log import setup as setup_log


class DataParallelEngine(Dispatcher):
    """Implements the Engine protocol over N worker processes on this host."""

    def __init__(self, config: EngineConfig, *, wait: bool = True):
        super().__init__()
        share = config.engines_per_gpu
        devices = [device for device in config.devices for _ in range(share)]
        context = mp.get_context("spawn")  # vLLM and CUDA do not survive fork
        started: dict[str, Any] = {}  # per GPU: the event its latest engine sets once it has started
        self._mps: mps.Daemon | None = None  # the CUDA MPS daemon its engines share a GPU through
        # The workers' output goes to the engine log, and that of multiprocessing's resource tracker,
        # which the first queue starts: it reports what a worker killed while starting left behind.
        with engine_processes() as self.engine_log:
            if config.mps:  # the plan's: engines share a GPU (plan/placement.use_mps)
                self._mps = mps.acquire(config.devices, self.engine_log.path)
            env = self._mps.env() if self._mps else {}
            self._results = context.Queue()
            for rank, device in enumerate(devices):
                tasks, ready = context.Queue(), context.Event()
                # One after another unless each engine's KV cache is fixed (by qbatch or the user), see above.
                after = None if config.start_together else started.get(device)
                turn = Turn(device, share, after, ready, env)
                started[device] = ready
                process = context.Process(target=_worker_main, name=f"qbatch-dp-{rank}",
                                          args=(rank, len(devices), turn, config, tasks, self._results))
                process.start()
                # the turn stays referenced: Process.start() drops its arguments (Python 3.12), and an event
                # collected before a child unpickled it takes its semaphore along (FileNotFoundError there)
                self._workers[rank] = Worker(rank, f"worker {rank} (device {device})", (process, tasks, turn))
        atexit.register(self.close)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Return once the first engine is ready (at once if one was)."""
        if not self.engine_seqs:
            self.engine_seqs = self._wait_first_ready()

    def _wait_first_ready(self) -> int:
        """Wait for one engine: the run starts on it while the others start (they join when ready)."""
        self._starting = set(self._workers)
        waited = 0.0
        while True:
            try:
                message = self._results.get(timeout=POLL_S)
            except queue.Empty:
                waited += POLL_S
                dead = [w.rank for w in self._workers.values() if not self._is_alive(w)]
                if dead or waited > STARTUP_TIMEOUT_S:
                    self.engine_log.show_tail()
                    self.close()
                    raise ModelError(f"engine worker(s) {dead} exited while starting", hint="see the log above")
                continue
            match message:
                case Failed():  # before any engine runs: the settings are wrong for all of them
                    self.engine_log.show_tail()
                    self.close()
                    raise start_failure(message)
                case Want(rank=rank):
                    self._wanting.append(rank)
                case Ready(rank=rank, max_num_seqs=max_num_seqs):
                    self._starting.discard(rank)
                    log.info("engine %s ready %.1fs after the engines started, the run starts on it",
                             self._workers[rank].label, time.monotonic() - self.started_at)
                    return max_num_seqs

    def _send(self, worker: Worker, chunk: Chunk) -> None:
        worker.handle[1].put(chunk)

    def _drop(self, worker: Worker) -> None:
        if self._is_alive(worker):
            worker.handle[1].put(Drop())

    def _receive(self, timeout: float) -> Message | None:
        try:
            message: Message = self._results.get(timeout=timeout)
        except queue.Empty:
            return None
        return message

    def _is_alive(self, worker: Worker) -> bool:
        return bool(worker.handle[0].is_alive())

    def close(self) -> None:
        for worker in self._workers.values():
            if worker.rank in self._starting:  # holds no work: no need to wait for its engine to finish starting
                _kill_tree(worker.handle[0].pid)
            elif self._is_alive(worker):
                worker.handle[1].put(Stop())
        for worker in self._workers.values():
            process = worker.handle[0]
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        self._workers.clear()
        if self._mps:  # after its clients, the engines
            mps.release(self._mps)
            self._mps = None


def start_failure(message: Failed) -> QbatchError:
    """The error of a worker whose engine could not start, with the worker's own kind and hint."""
    error = message.error
    if error is not None:
        return type(error)(f"engine worker {message.rank} could not start: {error.message}", where=error.where,
                           hint=error.hint)
    return ModelError(f"engine worker {message.rank} could not start: {message.reason}")


def _kill_tree(pid: int | None) -> None:
    """Kill a worker and its engine's processes (they would outlive it)."""
    import psutil

    try:
        process = psutil.Process(pid)
        family = process.children(recursive=True) + [process]
    except psutil.Error:
        return
    for member in family:
        try:
            member.kill()
        except psutil.Error:
            pass


@dataclass
class Turn:
    """Where a worker's engine runs and when it may start: after the engine before it on its GPU."""

    device: str
    share: int  # engines on this GPU
    after: Any  # that engine's "started" event, or None
    started: Any  # set once this engine has started (or failed to)
    env: dict[str, str] = field(default_factory=dict)  # what the worker adds to its environment (CUDA MPS: mps.py)


def _worker_main(rank: int, world: int, turn: Turn, config: EngineConfig, tasks: Any, results: Any) -> None:
    enter_engine_process()  # its output, and its engine's, to the engine log
    setup_log("log")  # its qbatch lines there too, at INFO (its engine's warm-up: warm_up.py)
    os.environ["CUDA_VISIBLE_DEVICES"] = turn.device
    os.environ.update(turn.env)
    try:
        import setproctitle

        setproctitle.setproctitle(f"qbatch::dp-worker-{rank}")
    except ImportError:
        pass
    try:
        # anything queued before this engine said Ready is the coordinator's Stop: the run ended first
        engine = _start_in_turn(turn, config, rank, world, stopped=lambda: not tasks.empty())
    except BaseException as exc:  # reported to the coordinator, which says so and stops
        # a qbatch error travels whole: its kind and hint (too little memory, a missing model) are the answer
        results.put(Failed(rank, str(exc), exc if isinstance(exc, QbatchError) else None))
        return
    if engine is None:
        return
    results.put(Ready(rank, engine.max_num_seqs))
    parent = os.getppid()
    stats_stopped = threading.Event()
    send_stats(engine, rank, results.put, stats_stopped)
    try:
        _serve_chunks(engine, rank, tasks, results, orphaned=lambda: os.getppid() != parent)
    except BaseException as exc:
        results.put(Failed(rank, first_line(exc)))
    finally:
        stats_stopped.set()
        engine.close()  # a multiprocessing child skips atexit: vLLM's engine process would outlive it


def _serve_chunks(engine: Any, rank: int, tasks: Any, results: Any, orphaned: Callable[[], bool]) -> None:
    """Run the coordinator's chunks until Stop; a Drop aborts the requests the engine holds (their run
    stopped early: VllmEngine.run aborts them on the way out) and the engine takes the next run's chunks."""
    while True:
        answers = Answers(rank)
        try:
            for finished in engine.run(Feed(tasks, ask=lambda: results.put(Want(rank)), orphaned=orphaned)):
                if finished is not None:
                    results.put(answers.finished(*finished)[0])
            return
        except Dropped:
            continue


def _start_in_turn(turn: Turn, config: EngineConfig, rank: int, world: int,
                   stopped: Callable[[], bool] = lambda: False) -> Any | None:
    """Import while the engine before this one on the GPU starts, then start it (its share of the GPU
    is in its LLM(...) arguments); None when the run ended first."""
    try:
        if turn.after is not None:
            import vllm  # noqa: F401  (the slow imports overlap the other engine's start)

            while not turn.after.wait(POLL_S):
                if stopped():
                    return None
        if stopped():
            return None
        return start_engine(config, rank, world)
    finally:
        turn.started.set()
