"""Runs that survive: SIGKILL at random points, a dead engine, a full disk, a second run.

The kill test drives the real CLI in subprocesses on the null engine, at random moments: each input row
must end in the results exactly once, whatever moment the run died.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from qbatch.errors import EXIT_ENGINE, EngineError

ROOT = Path(__file__).resolve().parents[2]


def qbatch_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "qbatch.cli", "run", *map(str, args)]


def part_ids(out: Path) -> list[str]:
    ids: list[str] = []
    for path in sorted((out / "parts").glob("part-*.parquet")):
        ids += pq.read_table(path, columns=["id"]).column("id").to_pylist()  # every part readable
    return ids


def wait_for_parts(proc: subprocess.Popen, out: Path, more_than: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list((out / "parts").glob("part-*.parquet"))) > more_than:
            return
        time.sleep(0.05)


@pytest.mark.parametrize("command", ["run", "embed"])
def test_sigkill_at_random_points_then_resume_loses_and_doubles_nothing(command, bundled_model, tmp_path):
    """The whole process group SIGKILLed at random moments of a run (reading, generating, writing parts,
    the manifest, assembling), on the null engine, whose rows come back at once so that every moment of
    the pipeline can be hit; then a plain rerun: every row once, in input order, nothing half-written.
    (The real engine's stops, SIGTERM and SIGKILL, each once: test_signals.py.)"""
    rng = random.Random(1234)
    rows = [{"id": f"r{i:05d}", "prompt": "word " * rng.randint(1, 30)} for i in range(20_000)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "qbatch.cli", command, str(inp), "-o", str(out), "--model", bundled_model,
           "--backend", "null", "--chunk-tokens", "3000", "--progress", "none"]
    if command == "run":
        cmd += ["--max-tokens", "4"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    kills = 0
    for _ in range(8):  # until two kills landed mid-run (a run may finish before its moment comes)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True, text=True)
        wait_for_parts(proc, out, more_than=len(list((out / "parts").glob("part-*.parquet"))), timeout=120)
        time.sleep(rng.uniform(0.0, 1.0))
        if proc.poll() is not None:
            assert proc.returncode == 0, proc.stderr.read()
            break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        ids = part_ids(out)  # every part readable
        assert len(ids) == len(set(ids))  # no doubles
        if kills == 2:
            break
    assert kills == 2

    final = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stdout + final.stderr
    ids = part_ids(out)
    assert sorted(ids) == [r["id"] for r in rows] and len(ids) == len(set(ids))
    results = pl.read_parquet(out / "results.parquet")
    assert results["id"].to_list() == [r["id"] for r in rows]
    assert not list(out.rglob("*.tmp-*"))
    assert json.loads((out / "manifest.json").read_text())["status"] == "completed"


class FailingEngine:
    """Finishes `good` chunks, then dies the way a crashed engine does."""

    max_num_seqs = 8

    def __init__(self, good: int):
        self.good = good

    def run(self, chunks):
        from qbatch.engines.base import NullEngine

        for n, done in enumerate(NullEngine().run(chunks)):
            if n == self.good:
                raise EngineError("the engine failed: EngineDeadError", hint="rerun the same command to resume")
            yield done


@pytest.fixture
def small_job(write_jsonl, bundled_model, tmp_path):
    path = write_jsonl([{"id": i, "prompt": f"prompt {i} " * 5} for i in range(40)])
    return ["run", path, "-o", tmp_path / "out", "--model", bundled_model, "--backend", "null",
            "--chunk-tokens", 300, "--max-tokens", 4, "--progress", "none"]


def test_engine_failure_keeps_finished_parts_and_rerun_completes(cli, small_job, tmp_path):
    from qbatch.engines.pool import EnginePool

    out = tmp_path / "out"
    result = cli(*small_job, pool=EnginePool(start=lambda *a, **k: FailingEngine(good=2)))
    assert result.exit_code == EXIT_ENGINE
    assert "Error: the engine failed: EngineDeadError" in result.stderr
    assert len(part_ids(out)) > 0 and json.loads((out / "manifest.json").read_text())["status"] == "failed"
    result = cli(*small_job)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == [str(i) for i in range(40)]


def test_full_disk_stops_cleanly_and_resumes(cli, small_job, monkeypatch, tmp_path):
    from qbatch.output import folder as checkpoint

    out = tmp_path / "out"
    real_write = checkpoint.pq.write_table
    calls = {"n": 0}

    def write_then_fill_disk(table, where, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            Path(where).write_bytes(b"PAR1 torn")  # a partial temp file, as a full disk leaves
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(table, where, **kwargs)

    monkeypatch.setattr(checkpoint.pq, "write_table", write_then_fill_disk)
    monkeypatch.setattr("qbatch.jobs.parts.PART_MIN_S", 0.0)  # a part at each chunk's end: the third fails
    result = cli(*small_job)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: cannot write part-") and ": the disk is full (" in result.stderr
    assert "Hint: finished parts are intact: free space and rerun the same command to resume" in result.stderr
    assert len(part_ids(out)) > 0 and not list(out.rglob("*.tmp-*"))
    monkeypatch.undo()
    result = cli(*small_job)
    assert result.exit_code == 0, result.output
    ids = pl.read_parquet(out / "results.parquet")["id"].to_list()
    assert ids == [str(i) for i in range(40)]


def test_torn_temp_files_from_a_killed_run_are_removed(cli, small_job, tmp_path):
    out = tmp_path / "out"
    (out / "parts").mkdir(parents=True)
    torn = out / "parts" / "part-000007.parquet.tmp-4242"
    torn.write_bytes(b"PAR1\x00half a file")
    result = cli(*small_job)
    assert result.exit_code == 0, result.output
    assert not torn.exists()


def test_retry_errors_reprocesses_failed_rows(cli, write_jsonl, bundled_model, tmp_path):
    path = write_jsonl([{"id": "short", "prompt": "hi"}, {"id": "long", "prompt": "word " * 300}])
    out = tmp_path / "out"
    base = ["run", path, "-o", out, "--model", bundled_model, "--backend", "null", "--progress", "none"]
    assert cli(*base, "--max-model-len", 128).exit_code == 0
    assert pl.read_parquet(out / "errors.parquet")["id"].to_list() == ["long"]
    result = cli(*base, "--max-model-len", 128, "--retry-errors")  # same settings: fails again, no doubles
    assert pl.read_parquet(out / "errors.parquet")["id"].to_list() == ["long"]
    result = cli(*base, "--max-model-len", 1024, "--retry-errors")  # room for it now
    assert result.exit_code == 0, result.output
    assert "rows ok (this run)              1" in result.stdout  # only the failed row was redone
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["short", "long"]
    assert pl.read_parquet(out / "errors.parquet").height == 0


def test_status_json_for_schedulers(cli, small_job, tmp_path):
    cli(*small_job, "--limit", 10)
    result = cli("status", tmp_path / "out", "--json")
    info = json.loads(result.stdout)
    assert (info["rows_done"], info["rows_failed"], info["rows_remaining"]) == (10, 0, 0)
    assert info["completed"] is True and info["running"] is None
    assert info["last_run"]["rows_ok"] == 10
    result = cli("status", tmp_path / "out")
    assert "rows done       10" in result.stdout


def test_dedupe_killed_before_the_kept_row_is_written_still_processes_it(cli, write_jsonl, bundled_model, tmp_path):
    """The dropped duplicate's error row carries the kept row's id; it must not mark that id done."""
    from qbatch.engines.pool import EnginePool

    path = write_jsonl([{"id": "a", "prompt": "1"}, {"id": "b", "prompt": "2"}, {"id": "a", "prompt": "3"}])
    out = tmp_path / "out"
    job = ["run", path, "-o", out, "--model", bundled_model, "--backend", "null", "--dedupe", "--progress", "none"]
    assert cli(*job, pool=EnginePool(start=lambda *a, **k: FailingEngine(good=0))).exit_code == EXIT_ENGINE
    error_parts = sorted((out / "parts").glob("errors-*.parquet"))
    assert [pq.read_table(p).column("error").to_pylist() for p in error_parts] == [["duplicate_id"]]
    assert not list((out / "parts").glob("part-*.parquet"))  # died before the kept row's result
    result = cli(*job)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["a", "b"]
    errors = pl.read_parquet(out / "errors.parquet")
    assert errors.select("id", "row_index", "error").rows() == [("a", 2, "duplicate_id")]  # not doubled


READ_ONLY_HINT = "Hint: the output folder is on a read-only file system: pass another -o/--output-dir"
PERMISSION_HINT = ("Hint: this user may not write there: check the folder's owner and permissions, "
                   "or pass another -o/--output-dir")
READ_PERMISSION_HINT = "Hint: this user may not read it: check the file's owner and permissions"


def refuse(monkeypatch, target, name: str, code: int, applies) -> None:
    """Make target.name raise OSError(code) for the paths `applies` accepts: a read-only or
    forbidden folder, which chmod cannot make for root."""
    real = getattr(target, name)

    def refused(*args, **kwargs):
        if applies(*args):
            raise OSError(code, os.strerror(code), str(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, refused)


def under(out: Path, *names: str):
    return lambda path, *rest: Path(path).is_relative_to(out) and (not names or Path(path).name in names)


@pytest.mark.parametrize("case", ["lock", "mkdir", "temp cleanup", "parts listing", "manifest read", "manifest write"])
def test_an_output_folder_that_cannot_be_written_is_an_error_with_its_path(cli, small_job, monkeypatch, tmp_path,
                                                                           case):
    out = tmp_path / "out"
    if case != "mkdir":
        assert cli(*small_job).exit_code == 0  # the folder already holds parts
    if case == "lock":
        refuse(monkeypatch, os, "open", errno.EROFS,
               lambda path, flags, *rest: str(path).endswith(".qbatch.lock") and flags & (os.O_RDWR | os.O_WRONLY))
    elif case == "mkdir":
        refuse(monkeypatch, Path, "mkdir", errno.EACCES, under(out))
    elif case == "temp cleanup":
        (out / "parts" / "part-000099.parquet.tmp-1").write_bytes(b"torn")
        refuse(monkeypatch, Path, "unlink", errno.EROFS, under(out))
    elif case == "parts listing":
        refuse(monkeypatch, os, "scandir", errno.EACCES, under(out, "parts"))
    elif case == "manifest read":
        refuse(monkeypatch, Path, "read_text", errno.EACCES, under(out, "manifest.json"))
    else:
        refuse(monkeypatch, os, "replace", errno.EROFS, lambda src, dst: Path(dst).name == "manifest.json")
    result = cli(*small_job)
    assert result.exit_code == 1, result.output
    error, hint = result.stderr.splitlines()[:2]
    assert error.startswith("Error: cannot ") and f"({out}" in error
    hints = {"mkdir": PERMISSION_HINT, "parts listing": PERMISSION_HINT, "manifest read": READ_PERMISSION_HINT}
    assert hint == hints.get(case, READ_ONLY_HINT)
