"""A run that fails before writing any row (its engine does not start, its inputs are refused after the
output folder was opened) leaves the folder as it found it: no empty parts/, no lock, no manifest
(issue #53.7). What it keeps (vLLM's engine.log, which says why an engine failed) it names."""

from __future__ import annotations

import pytest

from qbatch.engines.pool import EnginePool
from qbatch.errors import EXIT_ENGINE, EXIT_INPUT, EngineError


def failing_start(*args, **kwargs):
    raise EngineError("the engine failed to start: out of memory", hint="lower --max-num-seqs")


@pytest.fixture
def job(write_jsonl, bundled_model):
    def args(out, rows=None):
        rows = rows or [{"id": str(i), "prompt": f"row {i}"} for i in range(5)]
        return ["run", write_jsonl(rows), "-o", out, "--model", bundled_model, "--backend", "null", "--progress", "none"]

    return args


def test_an_engine_that_fails_to_start_leaves_no_output_folder(cli, job, tmp_path):
    out = tmp_path / "out"
    result = cli(*job(out), pool=EnginePool(start=failing_start))
    assert result.exit_code == EXIT_ENGINE, result.output
    assert "Error: the engine failed to start: out of memory" in result.stderr
    assert not out.exists()


def test_a_folder_that_was_there_keeps_what_it_held_and_nothing_more(cli, job, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli(*job(out), pool=EnginePool(start=failing_start)).exit_code == EXIT_ENGINE
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_inputs_refused_after_the_folder_opened_leave_no_trace(cli, job, tmp_path):
    out = tmp_path / "out"
    result = cli(*job(out, [{"id": "a", "prompt": "1"}, {"id": "a", "prompt": "2"}]))  # duplicate ids: the pre-scan
    assert result.exit_code == EXIT_INPUT, result.output
    assert not out.exists()


def test_the_engine_log_stays_and_is_named(cli, job, tmp_path):
    out = tmp_path / "out"

    def start_writing_a_log(*args, **kwargs):
        (out / "engine.log").write_text("CUDA out of memory\n")
        failing_start()

    result = cli(*job(out), pool=EnginePool(start=start_writing_a_log))
    assert result.exit_code == EXIT_ENGINE
    assert sorted(p.name for p in out.iterdir()) == ["engine.log"]
    assert f"the run wrote no row: {out} keeps only engine.log" in result.stderr
