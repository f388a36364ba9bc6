"""Data parallel: two independent engine processes behind one coordinator (real engines, CPU).

(Two engines on one device, --engines-per-gpu 2, run in the bench smoke test.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_two_engines_one_output_and_a_dying_worker(tiny_qwen3, tmp_path):
    """Worker 1 is killed once it runs and a part is written: its chunks in flight go to worker 0."""
    import psutil

    rows = [{"id": f"r{i:03d}", "prompt": "word " * (1 + i % 40)} for i in range(240)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    # qbatch's log on stderr as the CLI sets it up: engine events ("worker 1 ... ready") are INFO records
    cmd = [sys.executable, "-m", "qbatch.cli",
           "run", str(inp), "-o", str(out), "--model", tiny_qwen3,
           "--max-model-len", "512", "--no-thinking", "--ignore-eos", "--max-tokens", "32",
           "--chunk-tokens", "900", "--max-num-seqs", "8", "--data-parallel-size", "2", "--progress", "log"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 400
    killed = False
    while time.monotonic() < deadline and proc.poll() is None and not killed:
        running = any("engine worker 1 (device 1) ready" in line for line in list(lines))
        if running and list((out / "parts").glob("part-*.parquet")):
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if "qbatch::dp-worker-1" in " ".join(child.cmdline()):
                        for sub in child.children(recursive=True):
                            sub.kill()
                        child.send_signal(signal.SIGKILL)
                        killed = True
                except psutil.Error:  # a child that exited meanwhile
                    continue
        time.sleep(0.1)
    proc.wait(timeout=600)
    reader.join(timeout=60)
    output = "".join(lines)
    assert proc.returncode == 0, output
    results = pl.read_parquet(out / "results.parquet")
    assert results["id"].to_list() == [r["id"] for r in rows]  # all rows, once, in input order
    assert (results["completion_tokens"] == 32).all()
    assert killed, output  # the job is long enough for worker 1 to run before it ends
    assert "warning: engine worker 1 (device 1) died" in output
    assert "before the setup ended" in output  # the workers started beside the tokenizer's load
