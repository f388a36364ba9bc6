"""Data parallel: two independent engine processes behind one coordinator (real engines, CPU).

(Two engines on one device, --engines-per-gpu 2, run in the bench smoke test.)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_two_engines_a_dying_worker_a_killed_cli_and_one_output(tiny_qwen3, tmp_path):
    """The data-parallel process tree, on real engines: worker 1 is killed once it runs and a part is
    written (its rows in flight go to worker 0, the run goes on); then the CLI itself is SIGKILLed alone
    (not its group) and every process it started dies with it; the rerun, on one engine (engine sizing
    may change between runs), completes: all rows once, in input order."""
    from tests.jobs.test_signals import GONE_WITHIN_S, Run

    rows = [{"id": f"r{i:03d}", "prompt": "word " * (1 + i % 40)} for i in range(400)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    # qbatch's log on stderr as the CLI sets it up: engine events ("worker 1 ... ready") are INFO records
    args = [str(inp), "-o", str(out), "--model", tiny_qwen3, "--max-model-len", "512", "--no-thinking",
            "--ignore-eos", "--max-tokens", "32", "--chunk-tokens", "900", "--max-num-seqs", "4", "--progress", "log"]
    run = Run([*args, "--data-parallel-size", "2"])
    deadline = time.monotonic() + 400
    killed = False
    while time.monotonic() < deadline and run.proc.poll() is None and not killed:
        running = any("engine worker 1 (device 1) ready" in line for line in list(run.stderr))
        if running and list((out / "parts").glob("part-*.parquet")):
            killed = _kill_worker(run.proc.pid, "qbatch::dp-worker-1")
        time.sleep(0.1)
    assert killed, "".join(run.stderr)  # the job is long enough for worker 1 to run before it ends
    while time.monotonic() < deadline and run.proc.poll() is None \
            and not any("engine worker 1 (device 1) died" in line for line in list(run.stderr)):
        time.sleep(0.1)
    parts = len(list((out / "parts").glob("part-*.parquet")))
    run.wait_for_parts(out, more_than=parts)  # worker 0 goes on alone
    run.proc.kill()
    run.proc.wait(timeout=30)
    output = "".join(run.stderr)
    assert run.survivors_after(GONE_WITHIN_S) == [], output
    assert "warning: engine worker 1 (device 1) died" in output
    assert "before the setup ended" in output  # the workers started beside the tokenizer's load

    # max_num_seqs sizes the engine, not the results: the rerun finishes the rest 32 rows at a time
    wide = [*args[:-4], "--max-num-seqs", "32", *args[-2:]]
    final = subprocess.run([sys.executable, "-m", "qbatch.cli", "run", *wide], cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
    assert final.returncode == 0, final.stderr
    results = pl.read_parquet(out / "results.parquet")
    assert results["id"].to_list() == [r["id"] for r in rows]  # all rows, once, in input order
    assert (results["completion_tokens"] == 32).all()


def _kill_worker(pid: int, title: str) -> bool:
    """SIGKILL the worker process titled `title` and its engine processes; whether it was found."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        try:
            if title in " ".join(child.cmdline()):
                for sub in child.children(recursive=True):
                    sub.kill()
                child.send_signal(signal.SIGKILL)
                return True
        except psutil.Error:  # a child that exited meanwhile
            continue
    return False
