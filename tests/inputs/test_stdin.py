"""Rows from standard input, pipes and FIFOs: spooled to a file, then run, fingerprinted and resumed as files are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from qbatch.errors import EXIT_INPUT, EXIT_MISMATCH

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"id": f"r{i}", "prompt": f"prompt {i}"} for i in range(4)]


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture
def null_args(bundled_model):
    return ["--model", bundled_model, "--backend", "null", "--progress", "none", "--max-tokens", 4]


@pytest.fixture
def piped(null_args):
    """piped(data, *args) -> click Result of `qbatch run ARGS` in-process, with `data` on stdin."""
    from qbatch.cli import cli

    def invoke(data: bytes, *args):
        return CliRunner().invoke(cli, ["run", *map(str, args), *map(str, null_args)], input=data,
                                  catch_exceptions=False)

    return invoke


def subprocess_run(args: list, null_args: list, **kwargs) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "qbatch.cli", "run", *map(str, args), *map(str, null_args)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=300, **kwargs)


def ids(out: Path) -> list[str]:
    return pl.read_parquet(out / "results.parquet")["id"].to_list()


def test_cat_into_run_dash_then_rerun_resumes_appends_and_refuses_other_rows(null_args, piped, tmp_path):
    out = tmp_path / "out"
    first = subprocess_run(["-", "-o", out, "--limit", 2], null_args, input=jsonl(ROWS))
    assert first.returncode == 0, first.stderr.decode()
    assert ids(out) == ["r0", "r1"]
    copies = list((out / "inputs").iterdir())
    assert [p.name for p in copies] == ["0-stdin.jsonl"] and copies[0].read_bytes() == jsonl(ROWS)

    result = piped(jsonl(ROWS), "-", "-o", out)  # the same rows again: resumes
    assert result.exit_code == 0, result.output
    assert "rows already done               2" in result.stdout and ids(out) == ["r0", "r1", "r2", "r3"]

    more = ROWS + [{"id": "r4", "prompt": "appended"}]
    result = piped(jsonl(more), "-", "-o", out)  # the same rows plus appended ones: only those run
    assert result.exit_code == 0, result.output
    assert "rows ok (this run)              1" in result.stdout and ids(out) == [f"r{i}" for i in range(5)]

    other = subprocess_run(["-", "-o", out], null_args, input=jsonl(ROWS[::-1]))
    assert other.returncode == EXIT_MISMATCH, other.stderr.decode()
    stderr = other.stderr.decode()
    assert f"input {out / 'inputs' / '0-stdin.jsonl'} changed (not only appended to)" in stderr
    assert "Hint: rerun with --restart" in stderr and "Traceback" not in stderr
    assert not list((out / "inputs").glob("*.tmp-*"))


def test_dev_stdin_and_process_substitution_in_a_dry_run(null_args, tmp_path):
    """`/dev/stdin` and `<(...)` are pipes: spooled, every row counted, no 'not seekable' traceback."""
    other = tmp_path / "other.jsonl"
    other.write_bytes(jsonl([{"id": f"o{i}", "prompt": "other"} for i in range(3)]))
    cmd = [sys.executable, "-m", "qbatch.cli", "run", "/dev/stdin", f"<(cat {other})", "--dry-run", *map(str, null_args)]
    script = " ".join(arg if arg.startswith("<(") else f"'{arg}'" for arg in cmd)
    result = subprocess.run(["bash", "-c", script], cwd=ROOT, input=jsonl(ROWS), capture_output=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr.decode()
    assert "rows valid               7" in result.stdout.decode()


def test_dash_in_a_dry_run_and_with_parquet(piped, tmp_path):
    result = piped(jsonl(ROWS), "-", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "rows valid               4" in result.stdout
    parquet = tmp_path / "in.parquet"
    pl.DataFrame(ROWS).write_parquet(parquet)
    out = tmp_path / "out"
    result = piped(parquet.read_bytes(), "-", "-o", out, "--format", "parquet")
    assert result.exit_code == 0, result.output
    assert ids(out) == [r["id"] for r in ROWS]
    assert [p.name for p in (out / "inputs").iterdir()] == ["0-stdin.parquet"]


def test_a_fifo_is_spooled(piped, tmp_path):
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(jsonl(ROWS)), daemon=True)  # blocks until read
    writer.start()
    out = tmp_path / "out"
    result = piped(b"", fifo, "-o", out)
    writer.join(timeout=30)
    assert result.exit_code == 0, result.output
    assert ids(out) == [r["id"] for r in ROWS]


def test_stdin_twice_or_from_a_terminal_is_refused(piped, tmp_path):
    result = piped(jsonl(ROWS), "-", "/dev/stdin", "-o", tmp_path / "out")
    assert result.exit_code == EXIT_INPUT
    assert result.stderr.startswith("Error: standard input is given more than once; it can be read only once")

    from qbatch.inputs import spool
    from qbatch.spec import JobSpec

    class Terminal:
        buffer = type("Tty", (), {"isatty": staticmethod(lambda: True)})()

    spec = JobSpec.from_flat({"inputs": ["-"]})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spool.sys, "stdin", Terminal())
        with pytest.raises(spool.InputError, match="standard input is a terminal") as info:
            spool.spool_streams(spec, tmp_path)
    assert "cat prompts.jsonl | qbatch run - -o out/" in info.value.hint


def test_a_job_file_may_name_standard_input(tmp_path):
    from qbatch.spec import load_job_file

    job = tmp_path / "jobs" / "job.toml"
    job.parent.mkdir()
    job.write_text('inputs = ["-", "p.jsonl"]\noutput_dir = "out"\n')
    values = load_job_file(job)
    assert values["inputs"] == ["-", str(job.parent / "p.jsonl")]


def test_a_byte_order_mark_on_standard_input(piped, tmp_path):
    out = tmp_path / "out"
    result = piped(b"\xef\xbb\xbf" + jsonl(ROWS), "-", "-o", out)
    assert result.exit_code == 0, result.output
    assert ids(out) == [r["id"] for r in ROWS]


def test_a_json_array_on_standard_input(piped, tmp_path):
    """A JSON array piped in is copied as a .json file, whose objects are the rows (--format jsonl or not)."""
    data = json.dumps(ROWS, indent=2).encode()
    for flags in ([], ["--format", "jsonl"]):
        out = tmp_path / f"out{len(flags)}"
        result = piped(data, "-", "-o", out, *flags)
        assert result.exit_code == 0, result.output
        assert ids(out) == [r["id"] for r in ROWS]
        assert [p.name for p in (out / "inputs").iterdir()] == ["0-stdin.json"]
