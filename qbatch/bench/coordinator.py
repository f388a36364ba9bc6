"""The coordinator's ceiling: one driver (`qbatch run`'s process) against many simulated engines.

The driver reads, renders, tokenizes, plans, sends chunks, takes rows back and writes parts for
every engine; past some number of GPUs it, not the GPUs, sets the pace. To find that number the
real runner (jobs/runner.run) drives K simulated engines through the real coordinator
(engines/dispatch.Dispatcher): a simulator process holds them, speaks the workers' messages (Want,
Finished) and answers each chunk at once (or after `seconds_per_token` x its tokens, an engine's
batch time), with an output text of about the row's max_tokens words, so the driver also writes
what a real run writes. Every message crosses the process boundary pickled, as a chunk does to a
worker process or a Ray actor, and is counted (messages and bytes, each way).
"""

from __future__ import annotations

import contextlib
import heapq
import multiprocessing as mp
import os
import pickle
import queue
import random
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qbatch.engines.base import Chunk
from qbatch.engines.dispatch import Dispatcher, Worker
from qbatch.engines.messages import Finished, Message, Output, Want
from qbatch.engines.pool import EnginePool

MAX_NUM_SEQS = 256  # a simulated engine's rows at once (vLLM's default); it asks for more below 1.5x that
FEED_FACTOR = 1.5
TEXT_WORDS = 8192  # the simulator's output texts are slices of this many random words
_STOP = b""


@dataclass
class Wire:
    """What crossed the process boundary, each way: messages and their pickled bytes."""

    messages_out: int = 0
    bytes_out: int = 0
    messages_in: int = 0
    bytes_in: int = 0


class SimulatedEngines(Dispatcher):
    """The Engine protocol over `num_engines` engines simulated in one process of their own."""

    def __init__(self, num_engines: int, *, seconds_per_token: float = 0.0):
        super().__init__()
        context = mp.get_context("spawn")
        self._tasks, self._results = context.Queue(), context.Queue()
        self._process = context.Process(target=simulate, name="qbatch-simulated-engines", daemon=True,
                                        args=(num_engines, seconds_per_token, self._tasks, self._results))
        self._process.start()
        self.engine_seqs = MAX_NUM_SEQS
        self.num_engines = num_engines
        self.wire = Wire()
        for rank in range(num_engines):
            self._workers[rank] = Worker(rank, f"simulated engine {rank}", None)

    def _send(self, worker: Worker, chunk: Chunk) -> None:
        data = pickle.dumps((worker.rank, chunk), pickle.HIGHEST_PROTOCOL)
        self.wire.messages_out += 1
        self.wire.bytes_out += len(data)
        self._tasks.put(data)

    def _receive(self, timeout: float) -> Message | None:
        try:
            data = self._results.get(timeout=timeout)
        except queue.Empty:
            return None
        self.wire.messages_in += 1
        self.wire.bytes_in += len(data)
        message: Message = pickle.loads(data)
        return message

    def _is_alive(self, worker: Worker) -> bool:
        return self._process.is_alive()

    def close(self) -> None:
        if self._process.is_alive():
            self._tasks.put(_STOP)
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()


@dataclass(order=True)
class _Due:
    at: float
    number: int
    rank: int = field(compare=False)
    chunk: Chunk = field(compare=False)


def simulate(num_engines: int, seconds_per_token: float, tasks: Any, results: Any) -> None:
    """The simulated engines: each asks for chunks while it holds fewer than FEED_FACTOR x MAX_NUM_SEQS
    rows, and answers a chunk whole once its batch time has passed (at once when `seconds_per_token`
    is 0), one chunk after another."""
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 5))) for _ in range(TEXT_WORDS)]
    rows_held, busy_until = [0] * num_engines, [0.0] * num_engines
    due: list[_Due] = []

    def put(message: Message) -> None:
        results.put(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    for rank in range(num_engines):
        put(Want(rank))
    while True:
        timeout = max(0.0, due[0].at - time.monotonic()) if due else 1.0
        try:
            data = tasks.get(timeout=timeout) if timeout else tasks.get_nowait()
        except queue.Empty:
            data = None
        if data == _STOP:
            return
        if data is not None:
            rank, chunk = pickle.loads(data)
            tokens = sum(r.num_prompt_tokens + r.sampling["max_tokens"] for r in chunk.requests)
            busy_until[rank] = max(time.monotonic(), busy_until[rank]) + tokens * seconds_per_token
            heapq.heappush(due, _Due(busy_until[rank], chunk.index, rank, chunk))
            rows_held[rank] += len(chunk.requests)
            if rows_held[rank] < FEED_FACTOR * MAX_NUM_SEQS:
                put(Want(rank))
        while due and due[0].at <= time.monotonic():
            item = heapq.heappop(due)
            put(Finished(item.rank, item.number, list(range(len(item.chunk.requests))),
                         [_output(r, words) for r in item.chunk.requests]))
            had = rows_held[item.rank]
            rows_held[item.rank] -= len(item.chunk.requests)
            if had >= FEED_FACTOR * MAX_NUM_SEQS > rows_held[item.rank]:
                put(Want(item.rank))


def _output(request: Any, words: list[str]) -> Output:
    """About max_tokens words of text (one token each, roughly), at a place of the pool set by the row's id."""
    count = request.sampling["max_tokens"]
    start = hash(request.row_index) % (TEXT_WORDS - min(count, TEXT_WORDS - 1))
    return Output(" ".join(words[start:start + count]), "length", count, 0, None)


@dataclass
class CoordinatorRun:
    """One run of the driver against simulated engines: its counts, times, CPU and wire."""

    shape: str
    num_engines: int
    rows: int
    prompt_tokens: int
    output_tokens: int
    num_chunks: int
    num_parts: int  # parts written (jobs/parts.py)
    wall_s: float  # the whole run: setup, pre-scan, generation, assembly
    generate_s: float  # from the engines' start to the last row taken and written
    cpu_s: float  # the driver's own CPU (every thread), the whole run
    python_cpu_s: float  # of it, in Python's threads (the GIL lets one run Python at a time)
    # of that, the pre-scan's (Job.scan, its thread's CPU): a first run scans while its engines start, a
    # warm Session's run beside its first chunks, so it is no part of the feed once the engines are fed
    scan_cpu_s: float
    wire: Wire

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.generate_s

    def as_dict(self) -> dict[str, Any]:
        gen = self.generate_s
        return {**{k: v for k, v in asdict(self).items() if k != "wire"}, **asdict(self.wire),
                "rows_per_s": round(self.rows / gen, 1), "prompt_tok_per_s": round(self.prompt_tokens / gen),
                "output_tok_per_s": round(self.output_tokens / gen),
                "cpu_ms_per_row": round(1000 * self.cpu_s / max(1, self.rows), 3),
                "python_cpu_ms_per_row": round(1000 * self.python_cpu_s / max(1, self.rows), 3),
                "scan_cpu_ms_per_row": round(1000 * self.scan_cpu_s / max(1, self.rows), 3),
                "feed_python_ms_per_row": round(1000 * (self.python_cpu_s - self.scan_cpu_s) / max(1, self.rows), 3),
                "bytes_out_per_row": round(self.wire.bytes_out / max(1, self.rows)),
                "bytes_in_per_row": round(self.wire.bytes_in / max(1, self.rows)),
                "messages_per_chunk": round((self.wire.messages_out + self.wire.messages_in) / max(1, self.num_chunks),
                                            2)}


def run_coordinator(spec: Any, shape: str = "", *, seconds_per_token: float = 0.0) -> CoordinatorRun:
    """`spec` (a job spec, backend "null") run by the real runner on simulated engines, as many as its
    plan has engines (--data-parallel-size x --engines-per-gpu): the chunks are cut for that many."""
    from qbatch.jobs.runner import run

    engines: list[SimulatedEngines] = []

    def start(config: Any, *, wait: bool = True) -> SimulatedEngines:
        engines.append(SimulatedEngines(config.engine_count(), seconds_per_token=seconds_per_token))
        return engines[-1]

    cpu0, started = _cpu_seconds(), time.monotonic()
    with ThreadCpu() as threads, EnginePool(start=start) as pool, _scan_cpu() as scan:
        summary = run(spec, pool)
    wall_s, cpu_s = time.monotonic() - started, _cpu_seconds() - cpu0
    return CoordinatorRun(shape, engines[0].num_engines, summary.rows_ok, summary.prompt_tokens,
                          summary.completion_tokens, summary.num_chunks, len(summary.parts), round(wall_s, 3),
                          round(summary.generate_s, 3), round(cpu_s, 3), round(threads.python_s, 3),
                          round(scan[0], 3), engines[0].wire)


@contextlib.contextmanager
def _scan_cpu() -> Iterator[list[float]]:
    """The CPU seconds the pre-scan's thread spends in Job.scan while the block runs (one figure, in a list)."""
    from qbatch.jobs.job import Job

    spent = [0.0]
    scan = Job.scan

    def timed(job: Job, *args: Any, **kwargs: Any) -> Any:
        before = time.thread_time()
        try:
            return scan(job, *args, **kwargs)
        finally:
            spent[0] += time.thread_time() - before

    Job.scan = timed  # type: ignore[method-assign, assignment]
    try:
        yield spent
    finally:
        Job.scan = scan  # type: ignore[method-assign]


class ThreadCpu:
    """CPU seconds of this process's Python threads while the block runs (from /proc, sampled every
    SAMPLE_S): the rest ran in native threads (the tokenizer's pool, Arrow's), which spread over a
    host's cores while Python's threads share one GIL. A thread that ends loses at most its last SAMPLE_S."""

    SAMPLE_S = 0.2

    def __init__(self) -> None:
        self._ticks: dict[int, int] = {}  # thread id -> its CPU clock ticks when last seen
        self._start: dict[int, int] = {}
        self._python: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="qbatch-thread-cpu", daemon=True)

    @property
    def python_s(self) -> float:
        ticks = sum(self._ticks[t] - self._start.get(t, 0) for t in self._python if t in self._ticks)
        return ticks / os.sysconf("SC_CLK_TCK")

    def _read(self) -> None:
        self._python.update(t.native_id for t in threading.enumerate() if t.native_id is not None)
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:  # it ended
                continue
            self._ticks[int(tid)] = int(fields[11]) + int(fields[12])  # utime + stime

    def _sample(self) -> None:
        while not self._stop.wait(self.SAMPLE_S):
            self._read()

    def __enter__(self) -> ThreadCpu:
        self._read()
        self._start = dict(self._ticks)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()


def write_shape(shape: str, tokenizer: Any, num_rows: int, path: Path, *, seed: int = 0) -> dict[str, Any]:
    """A bench workload's rows (workloads.py) as a JSONL job at `path`; its description."""
    from qbatch.bench.workloads import make_workload

    workload = make_workload(shape, tokenizer, num_rows, seed=seed)
    workload.write_jsonl(path)
    return {**workload.describe(), "tokenizer_cpu_ms_per_row": tokenizer_cpu_ms(tokenizer, workload.prompts)}


def tokenizer_cpu_ms(tokenizer: Any, prompts: list[str]) -> float:
    """CPU milliseconds (every thread) a rendered prompt costs the fast tokenizer's batch encoder, the
    call the driver makes (qbatch/tokens.py): the driver's work that spreads over a host's cores."""
    from qbatch.tokens import TextEncoder

    encode = TextEncoder(tokenizer).encode
    encode(prompts[:64], add_special_tokens=False)  # its thread pool up, its backend checked
    cpu0 = _cpu_seconds()
    for start in range(0, len(prompts), 8192):
        encode(prompts[start:start + 8192], add_special_tokens=False)
    return round(1000 * (_cpu_seconds() - cpu0) / max(1, len(prompts)), 4)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
