"""The coordinator's ceiling harness (qbatch/bench/coordinator.py, benchmarks/coordinator.py): the real
runner against simulated engines on a tiny job. What it counts is checked, and what one driver does a
chunk: one message out, its rows back in one answer, token ids and sampling alone on the wire, and
parts not one a chunk (many engines get small chunks: docs/benchmarks.md, "the coordinator's ceiling")."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from qbatch.bench.coordinator import run_coordinator
from qbatch.jobs.parts import PART_MIN_S
from qbatch.spec import JobSpec

NUM_ROWS = 400
NUM_GPUS = 16


def test_the_driver_feeds_simulated_engines_a_message_a_chunk_and_writes_parts_by_time(bundled_model, write_jsonl,
                                                                                        tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"question {i}: " + "word " * (i % 40), "max_tokens": 20 + i % 50}
            for i in range(NUM_ROWS)]
    path = write_jsonl(rows)
    out = tmp_path / "out"
    spec = JobSpec.from_flat({"inputs": [str(path)], "output_dir": str(out), "model": bundled_model,
                              "backend": "null", "progress": "none", "telemetry": False, "ignore_eos": True,
                              "data_parallel_size": NUM_GPUS, "engines_per_gpu": 2, "chunk_tokens": 1000},
                             source="test")

    run = run_coordinator(spec, "tiny")

    assert run.num_engines == 2 * NUM_GPUS
    assert run.rows == NUM_ROWS and run.output_tokens == sum(r["max_tokens"] for r in rows)
    results = pq.read_table(out / "results.parquet")
    assert sorted(results.column("id").to_pylist()) == sorted(r["id"] for r in rows)
    assert run.prompt_tokens == sum(results.column("prompt_tokens").to_pylist())
    assert run.num_chunks >= 20
    wire = run.wire
    assert wire.messages_out == run.num_chunks  # one message a chunk
    # back: a chunk's rows in one answer, and a request for more from an engine now and then
    assert run.num_chunks <= wire.messages_in <= 2 * run.num_chunks + run.num_engines
    # a prompt's text (records.PromptText) and sampling travel, not the carried columns nor --include-prompt's copy
    texts = sum(len(r["prompt"]) for r in rows) / run.rows
    assert texts < wire.bytes_out / run.rows < 1.5 * texts + 600
    # parts by time and rows, not one a chunk: at most one at once, one per PART_MIN_S after, one at the end
    assert run.num_parts <= 2 + run.generate_s / PART_MIN_S < run.num_chunks
    report = run.as_dict()
    assert report["rows_per_s"] > 0
    assert 0 < run.scan_cpu_s < run.python_cpu_s  # the pre-scan's own share, told apart from the feed's
    assert json.loads((out / "stats.json").read_text())["num_chunks"] == run.num_chunks
