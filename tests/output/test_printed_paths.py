"""Every path qbatch prints is in normal form: `out/quickstart`, not `jobs/../out/quickstart` (a job file's
paths are relative to it) or `./out/`: in the summary, status, report, merge and error messages."""

from __future__ import annotations

import os

import pytest

from qbatch.errors import EXIT_INPUT


@pytest.fixture
def project(tmp_path, write_jsonl, monkeypatch):
    """A folder laid out as the repository's: jobs/q.toml reads ../data/in.jsonl into ../out/q."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "jobs").mkdir()
    write_jsonl([{"id": str(i), "prompt": f"hello {i}"} for i in range(3)], "data/in.jsonl")
    (tmp_path / "jobs" / "q.toml").write_text('inputs = ["../data/in.jsonl"]\noutput_dir = "../out/q"\n'
                                              'backend = "null"\nmodel = "smollm2-135m"\nprogress = "none"\n')
    return tmp_path


def test_the_summary_prints_a_job_files_paths_normalized(cli, project):
    result = cli("run", "--job", "jobs/q.toml")
    assert result.exit_code == 0, result.output
    assert f"results                         {os.path.join('out', 'q', 'results.parquet')} (3 rows)" in result.stdout
    assert ".." not in result.output


def test_status_report_and_merge_print_their_folders_normalized(cli, project):
    assert cli("run", "--job", "jobs/q.toml").exit_code == 0
    status = cli("status", "./jobs/../out/q/")
    assert status.stdout.startswith("qbatch status out/q\n"), status.stdout
    report = cli("report", "jobs/../out/q")
    assert report.stdout.strip() == "out/q/report.html"
    merged = cli("merge", "./jobs/../out/q", "-o", "out/all")
    assert merged.stderr.startswith("Error: a folder was not run with --shard (out/q)"), merged.output


def test_errors_name_a_job_files_paths_normalized(cli, project):
    (project / "jobs" / "missing.toml").write_text('inputs = ["../data/nope.jsonl"]\noutput_dir = "../out/m"\n'
                                                   'backend = "null"\nmodel = "smollm2-135m"\n')
    result = cli("run", "--job", "jobs/missing.toml")
    assert result.exit_code == EXIT_INPUT
    assert result.stderr.startswith("Error: input file not found (data/nope.jsonl)"), result.stderr
