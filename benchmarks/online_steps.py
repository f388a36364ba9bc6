"""Issue #54 without a model: the waits qbatch's online path adds, on engines whose steps take a fixed time.

A stand-in for vLLM's LLMEngine whose step sleeps STEP_MS (as on a GPU: the CPU is idle meanwhile) and finishes
a request MAX_TOKENS steps after it joined, up to 256 at once, drives the real VllmEngine.run through serve's
online Feeder (serve/gather.py) as `qbatch serve` does with no batch running: one engine in this process, or
(--engines N) N engines behind the coordinator of data-parallel workers (dispatch.py), each a thread here
running a worker's loop (processes._serve_chunks) with queues for the transport. CLIENTS threads each submit a
request (after JITTER_MS at most, at random: the SDK's and HTTP's own time, which spreads the requests over
steps), wait for its answer and submit the next, ROWS in all: what `ChatOpenAI.batch(max_concurrency=64)` does
against `qbatch serve`. The floor is MAX_TOKENS x STEP_MS a request; what comes above it is the jitter's and qbatch's.
With --batch-rows, a batch's rows (256 tokens out each) fill the engines first and the requests run beside it;
the stand-in schedules by priority as `qbatch serve`'s engines do, and as vLLM admits no waiting request while
MAX_NUM_SEQS run, whatever its priority.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/online_steps.py [--rows 640] [--clients 64] [--step-ms 10]
        [--max-tokens 32] [--engines 1] [--jitter-ms 20] [--batch-rows 0]

Prints one JSON line: requests/s, and p50/p90 a request against the floor.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from qbatch.engines.base import Chunk
from qbatch.engines.dispatch import Dispatcher, Worker
from qbatch.engines.processes import _serve_chunks
from qbatch.engines.vllm import VllmEngine
from qbatch.records import Request
from qbatch.serve.gather import Feeder, SharedEngine, Ticket

MAX_NUM_SEQS = 256


class SteppedLlmEngine:
    """vLLM's LLMEngine as VllmEngine.run drives it: each step sleeps, then every running request has one
    more token; a request is finished at its max_tokens-th step."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.waiting: deque[tuple[str, int]] = deque()
        self.running: dict[str, int] = {}
        self.urgent: set[str] = set()

    def add_request(self, request_id: str, prompt: Any, params: Any, lora_request: Any = None,
                    priority: int = 0) -> None:
        if priority < 0:  # vLLM's priority policy: before every waiting request of the default priority
            self.waiting.insert(sum(1 for r in self.waiting if r[0] in self.urgent), (request_id, params.max_tokens))
            self.urgent.add(request_id)
        else:
            self.waiting.append((request_id, params.max_tokens))

    def step(self) -> list[Any]:
        time.sleep(self.step_s)
        while self.waiting and len(self.running) < MAX_NUM_SEQS:  # vLLM admits no more, whatever the priority
            request_id, tokens = self.waiting.popleft()
            self.running[request_id] = tokens
        finished = []
        for request_id in list(self.running):
            self.running[request_id] -= 1
            if not self.running[request_id]:
                del self.running[request_id]
                sample = SimpleNamespace(text="ok", finish_reason="length", token_ids=[1], logprobs=None)
                finished.append(SimpleNamespace(finished=True, request_id=request_id, outputs=[sample],
                                                num_cached_tokens=0))
        return finished

    def abort_request(self, request_ids: list[str]) -> None:
        gone = set(request_ids)
        self.running = {k: v for k, v in self.running.items() if k not in gone}
        self.waiting = deque(r for r in self.waiting if r[0] not in gone)


def stepped_engine(step_s: float) -> VllmEngine:
    engine = object.__new__(VllmEngine)
    engine.llm = SimpleNamespace(llm_engine=SteppedLlmEngine(step_s))
    engine.max_num_seqs, engine.max_num_batched_tokens, engine._decoder, engine._next_id = MAX_NUM_SEQS, 8192, None, 0
    engine._prioritised = True  # as `qbatch serve`'s engines
    return engine


class ThreadWorkers(Dispatcher):
    """The data-parallel coordinator over worker threads: each runs a worker process's loop, queues between."""

    def __init__(self, count: int, step_s: float):
        super().__init__()
        self._results: queue.Queue[Any] = queue.Queue()
        for rank in range(count):
            tasks: queue.Queue[Any] = queue.Queue()
            threading.Thread(target=_serve_chunks, args=(stepped_engine(step_s), rank, tasks, self._results,
                                                         lambda: False), daemon=True).start()
            self._workers[rank] = Worker(rank, f"worker {rank}", tasks)

    def _send(self, worker: Worker, chunk: Any) -> None:
        worker.handle.put(chunk)

    def _receive(self, timeout: float) -> Any:
        try:
            return self._results.get(timeout=timeout)
        except queue.Empty:
            return None

    def _is_alive(self, worker: Worker) -> bool:
        return True


def start_batch(engine: Any, feeder: Feeder, rows: int) -> threading.Thread | None:
    """A run of `rows` rows on the engines, as a batch of `qbatch serve` runs (SharedEngine), in a thread; once
    its rows are in."""
    if not rows:
        return None
    chunk = Chunk(0, [Request(f"b{i}", 0, i, [1, 2, 3, 4], {"max_tokens": 256}, None, {}) for i in range(rows)])
    thread = threading.Thread(target=lambda: list(SharedEngine(engine, feeder).run([chunk])), daemon=True)
    thread.start()
    time.sleep(0.5)
    return thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=640)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--jitter-ms", type=float, default=20.0)
    parser.add_argument("--batch-rows", type=int, default=0,
                        help="a run of this many rows (256 tokens out each) beside the requests, started first")
    args = parser.parse_args()
    step_s = args.step_ms / 1000
    engine = stepped_engine(step_s) if args.engines == 1 else ThreadWorkers(args.engines, step_s)
    ready = threading.Event()
    ready.set()
    feeder = Feeder(SimpleNamespace(get=lambda config: engine), ready=ready, failed=lambda: None)
    feeder.config = SimpleNamespace(task="generate")

    def ask(i: int) -> float:
        time.sleep(random.Random(i).uniform(0, args.jitter_ms / 1000))
        ticket = Ticket([Request(f"r{i}", 0, i, [1, 2, 3, 4], {"max_tokens": args.max_tokens}, None, {})])
        t0 = time.perf_counter()
        feeder.submit(ticket)
        ticket.future.result(timeout=600)
        return time.perf_counter() - t0

    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(ask, range(-args.clients, 0)))  # warm: threads and the driver started
        batch = start_batch(engine, feeder, args.batch_rows)
        t0 = time.perf_counter()
        times = list(pool.map(ask, range(args.rows)))
        wall = time.perf_counter() - t0
        if batch is not None and not batch.is_alive():
            print(json.dumps({"warning": "the batch ended before the requests did"}))
    floor = args.max_tokens * step_s
    print(json.dumps({**vars(args), "requests_s": round(args.rows / wall, 2),
                      "floor_requests_s": round(min(args.clients, MAX_NUM_SEQS * args.engines) / floor, 2),
                      "p50_s": round(statistics.median(times), 4), "p90_s": round(statistics.quantiles(times, n=10)[-1], 4),
                      "floor_s": round(floor, 4)}))


if __name__ == "__main__":
    main()
