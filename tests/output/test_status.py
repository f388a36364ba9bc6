"""`qbatch status` while a run starts, after a killed run, on a merged folder, with dropped duplicates."""

from __future__ import annotations

import json

import pytest

from qbatch.output.folder import OutputDir

RERUN_HINT = "the run was stopped before it finished: rerun the same `qbatch run` command to resume"


@pytest.fixture
def job(write_jsonl, bundled_model, tmp_path):
    path = write_jsonl([{"id": f"r{i}", "prompt": f"p{i}"} for i in range(20)])
    return ["run", path, "-o", tmp_path / "out", "--model", bundled_model, "--backend", "null", "--progress", "none"]


def status(cli, folder):
    """(printed lines, --json fields) of `qbatch status FOLDER`."""
    printed, as_json = cli("status", folder), cli("status", folder, "--json")
    assert printed.exit_code == 0 and as_json.exit_code == 0, printed.output + as_json.output
    return printed.stdout.splitlines(), json.loads(as_json.stdout)


def test_a_run_that_has_not_written_its_manifest_yet_is_starting(cli, tmp_path):
    out = OutputDir(tmp_path / "out").open()  # a live run, in its first seconds: lock held, no manifest
    try:
        lines, info = status(cli, out.path)
    finally:
        out.close()
    assert info["status"] == "starting" and info["running"].startswith("pid ")
    assert (info["rows_done"], info["rows_total"], info["completed"]) == (0, None, False)
    assert f"  status          starting ({info['running']})" in lines


def test_a_killed_run_is_interrupted(cli, job, tmp_path):
    assert cli(*job, "--limit", 5).exit_code == 0
    manifest_path = tmp_path / "out" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "status": "running"}))  # what SIGKILL leaves behind
    lines, info = status(cli, tmp_path / "out")
    assert (info["status"], info["running"], info["hint"]) == ("interrupted", None, RERUN_HINT)
    assert "  status          interrupted" in lines and f"  hint            {RERUN_HINT}" in lines


def test_a_live_run_is_running(cli, job, tmp_path):
    assert cli(*job, "--limit", 5).exit_code == 0
    manifest_path = tmp_path / "out" / "manifest.json"
    manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), "status": "running"}))
    out = OutputDir(tmp_path / "out").open()
    try:
        lines, info = status(cli, out.path)
    finally:
        out.close()
    assert info["status"] == "running" and info["hint"] is None
    assert f"  status          running ({info['running']})" in lines


def test_a_merged_folder_counts_its_results(cli, job, tmp_path):
    shards = [tmp_path / f"s{i}" for i in range(2)]
    for i, folder in enumerate(shards):
        assert cli(*job[:3], folder, *job[4:], "--shard", f"{i}/2").exit_code == 0
    assert cli("merge", *shards, "-o", tmp_path / "all").exit_code == 0
    lines, info = status(cli, tmp_path / "all")
    assert (info["status"], info["rows_done"], info["rows_failed"], info["rows_remaining"]) == ("completed", 20, 0, 0)
    assert info["merged_from"] == [str(s.resolve()) for s in shards]
    assert "  rows done       20" in lines and "  merged from     2 shards" in lines


def test_a_dropped_duplicate_does_not_count_its_id_as_failed(cli, write_jsonl, bundled_model, tmp_path):
    """Same rule as resume: the duplicate_id error carries the kept row's id, which is still to do."""
    from qbatch.engines.pool import EnginePool
    from tests.jobs.test_durability import FailingEngine

    path = write_jsonl([{"id": "a", "prompt": "1"}, {"id": "b", "prompt": "2"}, {"id": "a", "prompt": "3"}])
    cli("run", path, "-o", tmp_path / "out", "--model", bundled_model, "--backend", "null", "--dedupe",
        "--progress", "none", pool=EnginePool(start=lambda *a, **k: FailingEngine(good=0)))
    lines, info = status(cli, tmp_path / "out")
    assert (info["status"], info["rows_done"], info["rows_failed"]) == ("failed", 0, 0)
    assert "  rows failed     0" in lines


def test_restart_wipes_the_telemetry_and_the_report_of_the_old_results(tmp_path):
    """--restart starts the output over: telemetry and report.html of the wiped results go with them."""
    from qbatch.output.folder import OutputDir

    out = OutputDir(tmp_path).open()
    try:
        (tmp_path / "telemetry").mkdir()
        (tmp_path / "telemetry" / "part-000001.parquet").write_bytes(b"x")
        for name in ("telemetry.parquet", "report.html", "manifest.json"):
            (tmp_path / name).write_text("x")
        out.wipe()
    finally:
        out.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".qbatch.lock", "parts"]


def test_status_says_the_last_runs_flagged_rows_with_their_fix(cli, job, tmp_path):
    """stats.json's `flags` (rows with no usable answer, or cut) show as output/flags.py says them."""
    assert cli(*job).exit_code == 0
    stats_path = tmp_path / "out" / "stats.json"
    stats = json.loads(stats_path.read_text())
    stats_path.write_text(json.dumps({**stats, "flags": {"in_reasoning": 3, "cut": 2}, "total_flags": 5}))
    lines, info = status(cli, tmp_path / "out")
    assert info["flags"] == {"in_reasoning": 3, "cut": 2}
    assert "  3 of 20 rows ended inside their reasoning (no answer): raise --max-tokens or pass --no-thinking" in lines
    assert "  2 of 20 rows were cut at max_tokens (finish_reason length): raise --max-tokens if the answers must be whole" in lines
