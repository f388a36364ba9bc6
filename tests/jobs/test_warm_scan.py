"""A run on an engine that is already up (a Session's, `qbatch serve`'s, a benchmark's) hands it the
first window's chunks before the pre-scan and scans while they run (jobs/opening.py): every row
still ends in the results or the errors once, and a scan that refuses the input leaves the output
folder as it was."""

from __future__ import annotations

import json

import polars as pl
import pytest

from qbatch.engines.base import NullEngine
from qbatch.engines.pool import EnginePool
from qbatch.errors import InputError
from qbatch.jobs import runner
from qbatch.jobs.job import Job
from qbatch.spec import JobSpec


class WarmEngine(NullEngine):
    """A null engine that counts the chunks it was given and notes when its run was closed early; it has
    a close(), so a pool keeps it, as it keeps a real engine."""

    def __init__(self):
        super().__init__()
        self.taken = 0
        self.closed_early = False

    def close(self):
        pass

    def run(self, chunks):
        def counted():
            for chunk in chunks:
                self.taken += chunk is not None
                yield chunk

        finished = False
        try:
            yield from super().run(counted())
            finished = True
        finally:
            self.closed_early = not finished


@pytest.fixture
def warm(monkeypatch):
    """A pool of the stand-in engine; what the engine had been given when the scan began."""
    engine = WarmEngine()
    pool = EnginePool(start=lambda *args, **kwargs: engine)
    scan = Job.scan
    at_scan = []

    def noting_scan(job, done):
        at_scan.append(engine.taken)
        return scan(job, done)

    monkeypatch.setattr(Job, "scan", noting_scan)
    return engine, at_scan, pool


def spec(path, out, **settings) -> JobSpec:
    return JobSpec.from_flat({"inputs": [str(path)], "output_dir": str(out), "model": "smollm2-135m", "progress": "none",
                              "telemetry": False, **settings}, source="test")


def up(pool: EnginePool, job_spec: JobSpec) -> JobSpec:
    """The job's engine started in `pool` before the run (as by a Session's earlier call)."""
    job = Job.setup(job_spec)
    pool.get(job.plan.engine)
    return job_spec


def test_the_scan_runs_beside_the_first_chunks_and_every_row_ends_once(warm, write_jsonl, tmp_path):
    engine, at_scan, pool = warm
    rows = [{"id": f"r{i}", "prompt": f"question {i} " * (1 + i % 7)} for i in range(1500)]
    rows[3] = {"id": "r3", "prompt": 42}  # a bad row in the first window: an error, recorded once the run is open
    summary = runner.run(up(pool, spec(write_jsonl(rows), tmp_path / "out")), pool)
    assert at_scan and at_scan[0] > 0  # the engine had chunks before the scan began
    assert engine.taken == summary.num_chunks and not engine.closed_early
    results = pl.read_parquet(tmp_path / "out" / "results.parquet")
    errors = pl.read_parquet(tmp_path / "out" / "errors.parquet")
    assert sorted(results["id"].to_list() + errors["id"].to_list()) == sorted(r["id"] for r in rows)
    assert errors["id"].to_list() == ["r3"] and results["id"].n_unique() == results.height == 1499
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["rows_total"] == 1500
    assert (summary.rows_ok, summary.rows_failed) == (1499, 1)


def test_a_scan_that_refuses_the_input_leaves_the_folder_as_it_was(warm, write_jsonl, tmp_path):
    """Duplicate ids at the end of the input are found by the scan after the engine got its first
    chunks: the run fails as a cold one does, its engine's run is closed, and nothing is written."""
    engine, at_scan, pool = warm
    rows = [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(1200)] + [{"id": "r7", "prompt": "again"}]
    out = tmp_path / "out"
    with pytest.raises(InputError, match="1 ids appear more than once: 'r7'"):
        runner.run(up(pool, spec(write_jsonl(rows), out)), pool)
    assert at_scan[0] > 0 and engine.closed_early
    assert [p.name for p in out.rglob("*") if p.is_file() and p.name != ".qbatch.lock"] == []  # no manifest, no part


def test_a_run_with_nothing_left_to_do_on_a_warm_engine(warm, write_jsonl, tmp_path):
    _, _, pool = warm
    path = write_jsonl([{"id": f"r{i}", "prompt": "hi"} for i in range(10)])
    runner.run(up(pool, spec(path, tmp_path / "out")), pool)
    again = runner.run(spec(path, tmp_path / "out"), pool)
    assert (again.rows_ok, again.rows_skipped) == (0, 10)
    assert pl.read_parquet(tmp_path / "out" / "results.parquet").height == 10


@pytest.mark.parametrize("engine_up", [True, False])
def test_a_stop_right_after_the_manifest_is_written_is_recorded(engine_up, warm, write_jsonl, tmp_path, monkeypatch):
    """Ctrl-C between the manifest's write and the end of the run's opening (here: the progress bar's
    start) marks the run interrupted, as later; `qbatch status` must not show it running."""
    from qbatch.jobs.progress import Progress

    _, _, pool = warm
    path = write_jsonl([{"id": f"r{i}", "prompt": f"question {i}"} for i in range(50)])
    if engine_up:
        up(pool, spec(path, tmp_path / "out"))

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Progress, "__init__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run(spec(path, tmp_path / "out"), pool)
    # no row was written: the run left the folder as it found it (#53.7), so nothing says it is running
    assert not (tmp_path / "out" / "manifest.json").exists() and not (tmp_path / "out" / ".qbatch.lock").exists()
