"""--backend ray: engines in Ray actors behind qbatch's coordinator (its core: test_dispatch.py).

The real test drives the CLI on a local Ray cluster with two CPU actors
running the tiny model, kills the driver and then an actor, and checks every
row ends in the results exactly once and no Ray process is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest

from qbatch.errors import EXIT_USAGE
from tests.jobs.test_signals import _alive, _num_parts, _part_ids  # the same scenario's checks, on Ray

ROOT = Path(__file__).resolve().parents[2]


def test_local_ranks_split_each_nodes_cores():
    from qbatch.engines.ray_actors import _local_ranks

    assert _local_ranks(["a", "b", "a", "a"]) == [(0, 3), (0, 1), (1, 3), (2, 3)]


@pytest.fixture
def ray_job(write_jsonl, bundled_model, tmp_path):
    path = write_jsonl([{"id": i, "prompt": f"prompt {i}"} for i in range(4)])
    return ["run", path, "-o", tmp_path / "out", "--model", bundled_model, "--progress", "none"]


def test_missing_ray_names_the_extra(cli, ray_job, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    result = cli(*ray_job, "--backend", "ray")
    assert result.exit_code == EXIT_USAGE
    assert result.stderr == "Error: --backend ray needs Ray, which is not installed\nHint: pip install 'qbatch[ray]'\n"


@pytest.mark.parametrize(("flags", "message"), [
    (["--backend", "ray", "--gpus", "0,1"], "Error: --gpus picks GPUs of this machine; with --backend ray, Ray assigns them"),
    (["--ray-address", "ray://head:10001"], "Error: --ray-address needs --backend ray"),
])
def test_ray_settings_that_cannot_work_are_refused(cli, ray_job, flags, message):
    result = cli(*ray_job, *flags)
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.splitlines()[0] == message


def test_a_run_may_move_between_the_vllm_and_ray_backends(bundled_model):
    from qbatch.jobs.job import Job
    from qbatch.plan import Machine, ModelFacts, resolve
    from qbatch.spec import JobSpec

    def fingerprint(backend: str) -> dict:
        spec = JobSpec.from_flat({"model": bundled_model, "backend": backend})
        return Job(resolve(spec, Machine(ModelFacts(bundled_model, max_model_len=512))), []).fingerprint()

    assert fingerprint("ray") == fingerprint("vllm") != fingerprint("null")


def test_an_actor_that_cannot_find_the_model_says_which_node():
    from qbatch.engines.config import EngineConfig
    from qbatch.engines.ray_actors import EngineActor
    from qbatch.errors import ModelError

    config = EngineConfig.of({}, backend="vllm", task="generate", model="m", model_path="/nowhere/model",
                             max_model_len=512)
    with pytest.raises(ModelError, match=r"^model folder not found on Ray node .+ \(/nowhere/model\)$") as info:
        EngineActor(config).start(0, 0, 1)
    assert info.value.hint == "every node needs the model at the same path: a shared filesystem, or a copy"


@pytest.mark.slow
def test_ray_backend_outlives_a_killed_actor_and_resumes_after_a_killed_driver(tiny_qwen3, cli, tmp_path):
    import psutil

    rows = [{"id": f"r{i:03d}", "prompt": "word " * (1 + i % 40)} for i in range(400)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    settings = ["--model", tiny_qwen3, "--max-model-len", "512", "--no-thinking", "--ignore-eos", "--max-tokens",
                "32", "--chunk-tokens", "900", "--max-num-seqs", "4", "--progress", "log"]
    cmd = [sys.executable, "-m", "qbatch.cli", "run", str(inp), "-o", str(out), *settings,
           "--backend", "ray", "--data-parallel-size", "2"]
    seen: dict[int, psutil.Process] = {}  # every process the runs started, Ray's included

    def start() -> subprocess.Popen:
        return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)

    def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
        try:
            found = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        seen.update((p.pid, p) for p in found)
        return found

    def wait_for_parts(proc: subprocess.Popen, more_than: int) -> None:
        deadline = time.monotonic() + 300
        while _num_parts(out) <= more_than and proc.poll() is None and time.monotonic() < deadline:
            descendants(proc)
            time.sleep(0.1)
        if proc.poll() is not None:  # say why it ended (the run's own log)
            raise AssertionError(f"the run ended (exit {proc.returncode}) before it could be killed")
        assert _num_parts(out) > more_than, "no new part within 300 s"

    first = second = None
    try:
        # 1. One of the two actors is SIGKILLed mid-run: its rows in flight go to the other, the run goes
        # on; then the driver is SIGKILLed: the parts it finished stay, each row in one of them.
        first = start()
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(first.stdout), daemon=True).start()
        wait_for_parts(first, 0)
        actor = next(p for p in descendants(first) if "ray::EngineActor" in " ".join(p.cmdline()))
        actor.kill()
        died = re.compile(r"engine actor [01] \(node .+, pid \d+\) died; its [0-9]+ rows in flight \([0-9]+ chunks\) go to the others")
        deadline = time.monotonic() + 120
        while not any(died.search(line) for line in list(lines)) and first.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(died.search(line) for line in list(lines)), "".join(lines)
        wait_for_parts(first, _num_parts(out))  # the other actor goes on
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        killed_at = time.monotonic()
        done = _part_ids(out)
        assert done and len(done) == len(set(done))

        # 2. The same command on one actor (engine sizing may change between runs) resumes and completes.
        cmd[-1] = "1"
        cmd[cmd.index("--max-num-seqs") + 1] = "32"  # it sizes the engine, not the results: the rest goes faster
        second = start()
        output, _ = second.communicate(timeout=300)
        assert second.returncode == 0, output
        assert f"{len(rows) - len(done)} rows to process, {len(done)} already done" in output
        ids = _part_ids(out)
        assert sorted(ids) == [r["id"] for r in rows]  # every row exactly once
        results = pl.read_parquet(out / "results.parquet")
        assert results["id"].to_list() == [r["id"] for r in rows] and (results["completion_tokens"] == 32).all()
        assert not list(out.rglob("*.tmp-*"))
        assert json.loads((out / "manifest.json").read_text())["status"] == "completed"

        # Same schema and layout as the plain backend's.
        plain = tmp_path / "plain"
        assert cli("run", inp, "-o", plain, *settings, "--backend", "null").exit_code == 0
        assert pl.read_parquet(plain / "results.parquet").schema == results.schema
        assert sorted(p.name for p in plain.iterdir()) == sorted(p.name for p in out.iterdir())

        # 3. No Ray process is left. After a SIGKILLed driver, Ray's two agents spend up to 60 s
        # reporting the dead cluster to its (dead) GCS before they exit.
        while any(_alive(p) for p in seen.values()) and time.monotonic() < killed_at + 90:
            time.sleep(1)
        assert [p for p in seen.values() if _alive(p)] == []
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for process in seen.values():
            if _alive(process):
                process.kill()
