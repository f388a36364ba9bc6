"""The driver's per-row work, stage by stage (issue #55, point 4): where one driver's Python time a row goes.

benchmarks/coordinator.py measures the whole driver against simulated engines; this takes its steps one at
a time, each on every row of a bench workload, in one thread, with the run's GC thresholds
(jobs/memory.rare_collections): the real Job and Preparer (read, render, encode, requests, order, cut),
the wire's pickling of chunks out and outputs back, and the pre-scan. Prints one line a stage: the thread's
CPU a row (time.thread_time, so the tokenizer's own threads are not counted), and the caller's wall for
the encode. docs/benchmarks.md ("the coordinator's ceiling") has the figures.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/driver_stages.py --model /work/shared/models/qwen3-0.6b-dummy \
        --shapes prefill-short,prefill,docqa
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qbatch.bench.coordinator import write_shape
from qbatch.engines.base import Chunk
from qbatch.engines.dispatch import slim
from qbatch.engines.messages import Output
from qbatch.jobs.chunking import cut_group_chunks, order_groups
from qbatch.jobs.job import Job
from qbatch.jobs.memory import rare_collections
from qbatch.output.done import DoneIds
from qbatch.spec import JobSpec

CHUNK_TOKENS = 2048  # the plan's chunk budget at 64 GPUs, 2 engines each (docs/benchmarks.md)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder (its tokenizer and chat template are used)")
    parser.add_argument("--shapes", default="prefill-short,prefill,docqa", help="bench workloads (workloads.py)")
    parser.add_argument("--rows", type=int, default=8192, help="rows per shape")
    args = parser.parse_args(argv)
    from qbatch.tokens import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    with tempfile.TemporaryDirectory(prefix="qbatch-stages-") as work, rare_collections():
        for shape in args.shapes.split(","):
            path = Path(work) / f"{shape}.jsonl"
            write_shape(shape, tokenizer, args.rows, path)
            spec = JobSpec.from_flat({"progress": "none", "model": args.model, "backend": "null",
                                      "inputs": [str(path)], "output_dir": str(Path(work) / "out"),
                                      "ignore_eos": True}, source="benchmarks/driver_stages.py")
            for name, us, wall_us in stages(Job.setup(spec)):
                wall = f"  (caller's wall {wall_us:,.1f} us a row)" if wall_us is not None else ""
                print(f"{shape:<14} {name:<22} {us:7.1f} us a row{wall}", flush=True)


def stages(job: Job) -> list[tuple[str, float, float | None]]:
    """(stage, its thread CPU a row in microseconds, the encode's wall a row or None), the steps in run order."""
    preparer = job.preparer
    timed: list[tuple[str, float, float | None]] = []

    def step(name: str, work: Callable[[], Any], num_rows: int, *, wall: bool = False) -> Any:
        cpu, started = time.thread_time(), time.perf_counter()
        result = work()
        cpu_us = 1e6 * (time.thread_time() - cpu) / num_rows
        timed.append((name, cpu_us, 1e6 * (time.perf_counter() - started) / num_rows if wall else None))
        return result

    done = DoneIds()
    num = sum(1 for _ in job.rows())
    job.scan(done)  # once untimed: the first pulls in what the read and the column types import
    step("pre-scan", lambda: job.scan(done), num)
    rows = step("read + id", lambda: list(job.identified_rows(done)), num)
    drafts, _ = step("render", lambda: preparer.render(rows), num)
    encoded = step("encode (caller)", lambda: preparer.encode(drafts), num, wall=True)
    requests, _ = step("requests", lambda: preparer.requests(drafts, encoded), num)
    groups = step("order (longest, prefixes)", lambda: order_groups(requests, job.spec.plan.order), num)
    chunks = step("cut chunks", lambda: list(cut_group_chunks(groups, CHUNK_TOKENS)), num)
    slimmed = step("slim (wire out)", lambda: [slim(Chunk(i, c), i) for i, c in enumerate(chunks)], num)
    step("pickle (wire out)", lambda: [pickle.dumps((0, c), pickle.HIGHEST_PROTOCOL) for c in slimmed], num)
    outputs = pickle.dumps([Output("word " * 8, "length", 8, 0, None) for _ in requests], pickle.HIGHEST_PROTOCOL)
    step("unpickle (wire in)", lambda: pickle.loads(outputs), num)
    return timed


if __name__ == "__main__":
    sys.exit(main())
