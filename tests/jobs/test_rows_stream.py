"""Rows count and reach parts as they finish, not when their chunk ends: a job of one chunk moves its
progress, writes parts throughout its generation, and a stop keeps the rows finished by then.

A stand-in engine finishes a chunk's rows over time and hands them back a few at a time, as vLLM's
engine does (engines/vllm.py); no model runs.
"""

from __future__ import annotations

import json
import os
import signal
import time

import polars as pl
import pyarrow.parquet as pq
import pytest

from qbatch.engines.base import NullEngine
from qbatch.engines.pool import EnginePool
from qbatch.errors import EXIT_SIGTERM
from qbatch.jobs import parts as part_rules
from qbatch.jobs import progress as progress_rules
from qbatch.jobs import runner
from qbatch.jobs.events import RunEvents
from qbatch.spec import JobSpec

NUM_ROWS = 60


def pool_of(engine_or_start) -> EnginePool:
    """A pool whose engines are this stand-in (or made by this function, one a run)."""
    start = engine_or_start if callable(engine_or_start) else lambda: engine_or_start
    return EnginePool(start=lambda *args, **kwargs: start())


class Trickle(NullEngine):
    """Finishes `every` rows of a chunk each `delay_s` seconds and hands them back (a tick, None, between);
    `on_piece(n)` runs after the n-th handful."""

    def __init__(self, delay_s: float = 0.02, every: int = 2, on_piece=lambda n: None):
        super().__init__()
        self.delay_s, self.every, self.on_piece = delay_s, every, on_piece
        self.pieces = 0

    def run(self, chunks):
        for chunk in chunks:
            if chunk is None:
                continue
            completions = [self._complete(r) for r in chunk.requests]
            for start in range(0, len(completions), self.every):
                time.sleep(self.delay_s)
                yield None
                yield chunk, completions[start:start + self.every]
                self.pieces += 1
                self.on_piece(self.pieces)


@pytest.fixture
def rows_path(write_jsonl):
    return write_jsonl([{"id": f"r{i:02d}", "prompt": f"question {i}"} for i in range(NUM_ROWS)])


def spec(path, out, **settings) -> JobSpec:
    return JobSpec.from_flat({"inputs": [str(path)], "output_dir": str(out), "model": "smollm2-135m",
                              "backend": "null", "progress": "none", "telemetry": False, **settings}, source="test")


def part_rows(out) -> list[list[str]]:
    return [pq.read_table(p, columns=["id"]).column("id").to_pylist()
            for p in sorted((out / "parts").glob("part-*.parquet"))]


def test_one_chunk_counts_its_rows_as_they_finish_and_writes_parts_throughout(rows_path, monkeypatch, tmp_path):
    engine = Trickle()
    monkeypatch.setattr(part_rules, "PART_MIN_S", 0.1)  # parts every 0.1 s of a ~0.6 s generation
    monkeypatch.setattr(progress_rules, "ON_PROGRESS_S", 0.0)  # every update reported
    seen = []
    out = tmp_path / "out"
    summary = runner.run(spec(rows_path, out), pool_of(engine),
                         RunEvents(on_progress=lambda done, _: seen.append(done)))

    assert summary.num_chunks == 1 and [c["rows"] for c in summary.chunks] == [NUM_ROWS]
    assert seen == list(range(2, NUM_ROWS + 1, 2))  # the progress moves with every handful of rows
    written = [p["written_s"] for p in summary.parts]
    assert 3 <= len(written) < engine.pieces  # by time, not one a handful
    assert written[0] < 0.5 * written[-1]  # spread over the generation, not all at its end
    assert [p["rows"] for p in summary.parts] == [len(ids) for ids in part_rows(out)]
    ids = [i for part in part_rows(out) for i in part]
    assert sorted(ids) == [f"r{i:02d}" for i in range(NUM_ROWS)]  # each row in exactly one part
    stats = json.loads((out / "stats.json").read_text())
    assert stats["parts"] == summary.parts and stats["chunks"][0]["finished_s"] >= written[-2]


def test_status_counts_the_rows_of_a_running_single_chunk_job(rows_path, monkeypatch, tmp_path):
    from qbatch.output.status import read_status

    out = tmp_path / "out"
    during = []
    engine = Trickle(on_piece=lambda n: during.append(read_status(str(out))) if n == 20 else None)
    monkeypatch.setattr(part_rules, "PART_MIN_S", 0.05)
    runner.run(spec(rows_path, out), pool_of(engine))
    status = during[0]
    assert status["status"] == "running" and 0 < status["rows_done"] < NUM_ROWS


def test_a_part_is_due_by_rows_or_by_time(monkeypatch, tmp_path):
    """The wait grows with the generation's time, between PART_MIN_S and PART_MAX_S; PART_MAX_ROWS
    rows waiting make a part at once."""
    from qbatch.jobs.parts import PartWriter, part_wait_s

    assert [part_wait_s(s) for s in (0, 50, 600, 36_000)] == [2.0, 2.0, 12.0, 60.0]
    writer = PartWriter(None, [], time.monotonic(), include_prompt=False)
    assert not writer.due(chunk_done=True)  # nothing waiting
    writer.add(["a row"], [])
    assert not writer.due() and writer.due(chunk_done=True)
    monkeypatch.setattr(part_rules, "PART_MAX_ROWS", 2)
    writer.add(["another"], [])
    assert writer.due()


def test_chunk_ends_make_parts_at_most_every_part_min_s(monkeypatch, tmp_path):
    """Many engines get small chunks that end many times a second: the first chunk's end makes a part at
    once, the next ones only PART_MIN_S after the last part (a Parquet file a chunk was the driver's
    ceiling: docs/benchmarks.md, "the coordinator's ceiling")."""
    from qbatch.jobs.parts import PartWriter
    from qbatch.output.folder import OutputDir
    from qbatch.records import Failure

    out = OutputDir(tmp_path / "out").open()
    try:
        writer = PartWriter(out, ["in.jsonl"], time.monotonic(), include_prompt=False)
        for i in range(3):
            writer.add([], [Failure(f"r{i}", "in.jsonl", i, i + 1, "bad", "a bad row")])
            if i == 0:
                assert writer.due(chunk_done=True)
                assert writer.write()["failed"] == 1
        assert not writer.due(chunk_done=True)  # a part was written just now
        monkeypatch.setattr(part_rules, "PART_MIN_S", 0.0)
        assert writer.due(chunk_done=True) and not writer.due()
    finally:
        out.close()


def test_a_stop_mid_chunk_keeps_the_rows_finished_and_the_rerun_redoes_only_the_rest(
        cli, bundled_model, rows_path, tmp_path):
    """SIGTERM while the one chunk runs, long before any part is due by time: the rows finished by then
    are written as the run stops; the rerun skips them by id and does the rest."""
    def terminate(n):
        if n == 12:
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # the CLI installs its own
    out = tmp_path / "out"
    args = ["run", rows_path, "-o", out, "--model", bundled_model, "--backend", "null", "--progress", "none"]
    try:
        result = cli(*args, pool=pool_of(lambda: Trickle(on_piece=terminate)))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.exit_code == EXIT_SIGTERM, result.output
    kept = part_rows(out)
    assert len(kept) == 1 and len(set(kept[0])) == 24  # 12 handfuls of 2, in one part written at the stop
    result = cli(*args)
    assert result.exit_code == 0, result.output
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["rows_skipped"], stats["rows_ok"]) == (24, NUM_ROWS - 24)
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == [f"r{i:02d}" for i in range(NUM_ROWS)]


def test_a_session_reports_progress_as_rows_finish(bundled_model, rows_path, monkeypatch, tmp_path):
    """About every ON_PROGRESS_S, and once all rows are done."""
    from qbatch.session import Session

    monkeypatch.setattr(progress_rules, "ON_PROGRESS_S", 0.2)
    reported = []
    with Session(bundled_model, backend="null", pool=pool_of(Trickle)) as session:
        session.run(rows_path, progress="none", on_progress=lambda done, failed: reported.append((done, failed)))
    assert 2 <= len(reported) < NUM_ROWS // 2 and reported[-1] == (NUM_ROWS, 0)  # by time, and the last
    assert [done for done, _ in reported] == sorted(done for done, _ in reported)


def test_a_stop_request_ends_the_run_with_the_rows_finished_written_and_a_rerun_resumes(rows_path, tmp_path):
    """The caller's stop (qbatch serve's cancel) is seen as the engine reports: the run writes what it
    finished, records itself interrupted by the stop's reason and returns; the rerun does the rest."""
    from qbatch.jobs.events import StopRequest

    stop = StopRequest()
    out = tmp_path / "out"
    engine = Trickle(on_piece=lambda n: stop.request("cancel") if n == 5 else None)
    summary = runner.run(spec(rows_path, out), pool_of(engine), RunEvents(stop=stop))
    assert summary.status == "interrupted" and summary.rows_ok == 10 and engine.pieces == 5
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["runs"][-1]["interrupted_by"] == "cancel"
    assert [len(ids) for ids in part_rows(out)] == [10] and not (out / "results.parquet").exists()
    again = runner.run(spec(rows_path, out), pool_of(Trickle))
    assert (again.status, again.rows_skipped, again.rows_ok) == ("completed", 10, NUM_ROWS - 10)
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == [f"r{i:02d}" for i in range(NUM_ROWS)]
