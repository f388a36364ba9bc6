"""A run's memory does not grow with its rows (issue #55.5): the pre-scan keeps 8 bytes a row for
exactly-once (jobs/ids.py), and the assembly reads and sorts a range of rows at a time (output/ranges.py).

Measured by tracemalloc and by which parts each range reads, not by RSS: a process's RSS between two
runs of 100k and 300k rows varied by 100 bytes a row from one run to the next on a loaded machine
(docs/benchmarks.md, "memory per row", has the RSS figures).
"""

import json
import tracemalloc

import pyarrow.parquet as pq
import polars as pl

from qbatch.jobs.job import Job
from qbatch.output.ranges import sink_by_ranges
from qbatch.spec import JobSpec

SCAN_BYTES_A_ROW = 32


def write_rows(path, num_rows: int, *, repeat_every: int = 0) -> None:
    with path.open("w") as handle:
        for i in range(num_rows):
            rid = i - 1 if repeat_every and i % repeat_every == 0 and i else i
            handle.write(json.dumps({"id": f"row-{rid:08d}", "prompt": f"Say hi {i}"}) + "\n")


def scan_peak(tmp_path, model: str, num_rows: int) -> int:
    """The pre-scan's peak of Python allocations (bytes) over `num_rows` rows with unique ids."""
    path = tmp_path / f"in-{num_rows}.jsonl"
    write_rows(path, num_rows)
    job = Job.setup(JobSpec.from_flat({"inputs": [str(path)], "model": model, "backend": "null"}))
    job.scan(set())  # the tokenizer loaded, and what the first scan imports, before measuring
    tracemalloc.start()
    try:
        scan = job.scan(set())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert scan.num_todo == num_rows and job.repeats.digests == set()
    return peak


def test_the_pre_scan_keeps_a_few_bytes_a_row(tmp_path, bundled_model):
    small, large = scan_peak(tmp_path, bundled_model, 10_000), scan_peak(tmp_path, bundled_model, 100_000)
    assert (large - small) / 90_000 <= SCAN_BYTES_A_ROW  # a dict of the ids took ~150


def test_dedupe_keeps_the_first_of_each_id_remembering_only_those_that_repeat(tmp_path, bundled_model):
    path = tmp_path / "in.jsonl"
    write_rows(path, 3_000, repeat_every=1_000)  # rows 1000 and 2000 repeat the ids of rows 999 and 1999
    job = Job.setup(JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, "backend": "null",
                                       "dedupe": True}))
    assert job.scan(set()).num_todo == 3_000
    assert len(job.repeats.digests) == 2
    windows = list(job._row_windows(set()))
    kept = [rid for window in windows for _, rid in window.rows]
    dropped = [(f.id, f.row_index) for window in windows for f in window.failures]
    assert len(kept) == len(set(kept)) == 2_998
    assert dropped == [("row-00000999", 1000), ("row-00001999", 2000)]


def test_the_assembly_reads_for_each_range_only_the_parts_that_hold_its_rows(tmp_path, run_null):
    path = tmp_path / "in.jsonl"
    write_rows(path, 4_000)
    out = tmp_path / "out"
    assert run_null(path, "-o", out, "--chunk-tokens", 2000, "--max-tokens", 4).exit_code == 0
    parts = sorted((out / "parts").glob("part-*.parquet"))
    assert len(parts) > 10
    read: list[int] = []

    def frame_of(paths):
        read.append(len(paths))
        return pl.concat([pl.scan_parquet(p) for p in paths], how="diagonal_relaxed")

    sink_by_ranges(parts, frame_of, tmp_path / "results.parquet", range_rows=500)
    assert max(read[1:]) < len(parts) / 2  # the first call reads the columns (footers) of all
    written = pq.read_table(tmp_path / "results.parquet")
    assert written.column("row_index").to_pylist() == list(range(4_000))
