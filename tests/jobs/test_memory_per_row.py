"""A run's memory does not grow with its rows (issue #55.5): the pre-scan keeps 8 bytes a row for
exactly-once (jobs/ids.py), a resumed run 16 bytes a done row (output/done.py), and the assembly reads
and sorts a range of rows at a time (output/ranges.py).

Measured by tracemalloc and by which parts each range reads, not by RSS: a process's RSS between two
runs of 100k and 300k rows varied by 100 bytes a row from one run to the next on a loaded machine
(docs/benchmarks.md, "memory per row", has the RSS figures).
"""

import json
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import polars as pl

from qbatch.jobs import runner
from qbatch.jobs.job import Job
from qbatch.output.done import DoneIds
from qbatch.output.folder import DUPLICATE_ID, OutputDir
from qbatch.output.ranges import sink_by_ranges
from qbatch.spec import JobSpec

SCAN_BYTES_A_ROW = 32
DONE_BYTES_A_ROW = 24  # 16-byte digests (15 measured); a set of the id strings took 92
DONE_PEAK_BYTES_A_ROW = 40  # while they are read and sorted (37)
RUN_BYTES_A_ROW = 32  # what the generation keeps of its rows (~1 measured): its parts hold them


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


def test_the_assembly_reads_for_each_range_only_the_parts_that_hold_its_rows(tmp_path, run_null, monkeypatch):
    monkeypatch.setattr("qbatch.jobs.parts.PART_MIN_S", 0.0)  # a part at each chunk's end
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


def write_done_parts(folder, num_rows: int, *, failed_every: int = 0) -> None:
    """A folder's parts holding `num_rows` results (ids row-N), 5,000 a part; and errors: each
    `failed_every`-th row's id failed (the even ones), or dropped by --dedupe (the odd ones)."""
    parts = folder / "parts"
    parts.mkdir(parents=True)
    for number, low in enumerate(range(0, num_rows, 5_000), 1):
        ids = [f"row-{i:08d}" for i in range(low, min(low + 5_000, num_rows))]
        pq.write_table(pa.table({"id": ids}), parts / f"part-{number:06d}.parquet")
    if failed_every:
        failed = [f"fail-{i:08d}" if i % 2 == 0 else f"row-{i:08d}" for i in range(0, num_rows, failed_every)]
        errors = [DUPLICATE_ID if i % 2 else "bad_line" for i in range(len(failed))]
        pq.write_table(pa.table({"id": failed, "error": errors}), parts / "errors-000001.parquet")


def done_bytes(tmp_path, num_rows: int) -> tuple[int, int]:
    """What a resumed run holds for the ids done in a folder of `num_rows` results, and its peak while
    reading them (bytes, tracemalloc)."""
    folder = tmp_path / f"out-{num_rows}"
    write_done_parts(folder, num_rows)
    OutputDir(folder).done_ids(include_errors=True)  # what reading Parquet imports and caches, before measuring
    tracemalloc.start()
    try:
        done = OutputDir(folder).done_ids(include_errors=True)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(done) == num_rows and f"row-{num_rows - 1:08d}" in done and f"row-{num_rows:08d}" not in done
    return held, peak


def test_a_resumed_run_holds_a_few_bytes_a_done_row(tmp_path):
    (small, small_peak), (large, large_peak) = done_bytes(tmp_path, 10_000), done_bytes(tmp_path, 60_000)
    assert (large - small) / 50_000 <= DONE_BYTES_A_ROW
    assert (large_peak - small_peak) / 50_000 <= DONE_PEAK_BYTES_A_ROW


def test_the_done_ids_are_the_results_and_the_failures_but_those_dedupe_dropped(tmp_path):
    write_done_parts(tmp_path, 20_000, failed_every=1_000)
    folder = OutputDir(tmp_path)
    done, ok, failed = folder.done_ids(include_errors=True), folder.result_ids(), folder.error_ids()
    expected_ok = {f"row-{i:08d}" for i in range(20_000)}
    expected_failed = {f"fail-{i:08d}" for i in range(0, 20_000, 2_000)}
    assert len(ok) == 20_000 and len(failed) == 10 and len(done) == 20_010
    assert all(rid in done for rid in expected_ok | expected_failed)
    assert not any(rid in ok for rid in expected_failed) and "row-00020000" not in done and 5 not in done
    assert len(folder.done_ids(include_errors=False)) == 20_000
    assert len(failed - ok) == 10 and len(ok - failed) == 20_000 and len(ok - ok) == 0
    assert len(DoneIds.of(["a", "b", "a"]) | DoneIds.of(["b", "c"])) == 3 and len(DoneIds()) == 0


def held_by_the_generation(tmp_path, monkeypatch, run_null, num_rows: int) -> int:
    """Python allocations a run of `num_rows` rows holds at its generation's end (bytes, tracemalloc from the
    generation's start to the assembly's): what the run, its progress, summary and stages keep per row."""
    path = tmp_path / f"in-{num_rows}.jsonl"
    write_rows(path, num_rows)
    held: list[int] = []
    generate, assemble = runner._Run._generate, runner.assemble

    def traced_generate(self, *args, **kwargs):
        tracemalloc.start()
        return generate(self, *args, **kwargs)

    def measured_assemble(*args, **kwargs):
        held.append(tracemalloc.get_traced_memory()[0])
        tracemalloc.stop()
        return assemble(*args, **kwargs)

    monkeypatch.setattr(runner._Run, "_generate", traced_generate)
    monkeypatch.setattr(runner, "assemble", measured_assemble)
    try:
        result = run_null(path, "-o", tmp_path / f"out-{num_rows}", "--max-tokens", 4, "--dedupe")
    finally:
        tracemalloc.stop()
    assert result.exit_code == 0, result.output
    return held[0]


def test_a_run_keeps_a_few_bytes_a_row_of_python_objects(tmp_path, monkeypatch, run_null):
    small = held_by_the_generation(tmp_path, monkeypatch, run_null, 3_000)
    large = held_by_the_generation(tmp_path, monkeypatch, run_null, 12_000)
    assert (large - small) / 9_000 <= RUN_BYTES_A_ROW
