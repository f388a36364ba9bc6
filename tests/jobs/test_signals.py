"""Stopping leaves nothing behind: SIGTERM/SIGINT stop a run cleanly, and a CLI killed outright takes its
engines with it.

The slow tests drive the real CLI in a subprocess with the real engine and watch every process the run
started: after the run is gone, none of them may live on (a vLLM engine holds gigabytes of GPU memory).
"""

from __future__ import annotations

import json
import re
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import polars as pl
import psutil
import pytest

from qbatch.errors import EXIT_LOCKED, EXIT_SIGTERM

ROOT = Path(__file__).resolve().parents[2]
# enough rows that the rerun of step 3 still runs well after its second worker joins (a worker starts
# after the other on the CPU, ~11 s later on CI's 2 cores): 400 once finished before the kill landed, and 800
# once ended 19 s after the join with the kill unnoticed (CI, session 62, beside another real-engine test)
ROWS = [{"id": f"r{i:04d}", "prompt": "word " * (1 + i % 30)} for i in range(1200)]
GONE_WITHIN_S = 20


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Run:
    """The CLI in a subprocess; remembers every process it started, whatever becomes of them."""

    def __init__(self, args: list[str], cmd: list[str] | None = None, env: dict[str, str] | None = None):
        cmd = cmd or [sys.executable, "-m", "qbatch.cli", "run", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.seen: dict[int, psutil.Process] = {}
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                for child in psutil.Process(self.proc.pid).children(recursive=True):
                    self.seen.setdefault(child.pid, child)
            except psutil.Error:
                return
            time.sleep(0.1)

    def wait_for_parts(self, out: Path, more_than: int = 0, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if len(list((out / "parts").glob("part-*.parquet"))) > more_than:
                return
            time.sleep(0.05)
        raise AssertionError("no part written in time:\n" + "".join(self.stderr))

    def engine_processes(self) -> list[psutil.Process]:
        return [p for p in self.seen.values() if _alive(p) and "EngineCore" in _title(p)]

    def survivors_after(self, seconds: float) -> list[str]:
        """The run's processes still alive `seconds` after now (checked until they are all gone)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            left = [p for p in self.seen.values() if _alive(p)]
            if not left:
                break
            time.sleep(0.25)
        self._stop.set()
        left = [p for p in self.seen.values() if _alive(p)]
        described = [f"{p.pid} {_title(p)}" for p in left]
        for p in left:  # leave nothing behind for the next test
            try:
                p.kill()
            except psutil.Error:
                pass
        return described


def _kill_worker(pid: int, title: str) -> bool:
    """SIGKILL the worker process titled `title` and its engine processes; whether it was found."""
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


def _set(args: list[str], flag: str, value: str) -> list[str]:
    """`args` with `flag`'s value replaced."""
    at = args.index(flag) + 1
    return [*args[:at], value, *args[at + 1:]]


def _title(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline()) or process.name()
    except psutil.Error:
        return "?"


@pytest.fixture(scope="module")
def job(tiny_qwen3, tmp_path_factory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("signals")
    inp = folder / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    # small chunks: many parts, so each stop lands mid-run
    args = ["--model", tiny_qwen3, "--max-model-len", "512", "--no-thinking", "--ignore-eos", "--max-tokens", "32",
            "--chunk-tokens", "900", "--max-num-seqs", "4", "--progress", "log"]
    return inp, args


def _part_ids(out: Path) -> list[str]:
    return [i for path in sorted((out / "parts").glob("part-*.parquet"))
            for i in pl.read_parquet(path, columns=["id"])["id"].to_list()]


def _num_parts(out: Path) -> int:
    return len(list((out / "parts").glob("part-*.parquet")))


@pytest.mark.slow
def test_a_run_stopped_every_way_resumes_with_each_row_once(job, tmp_path):
    """The one real-engine scenario for the ways a CLI run stops (each step costs an engine start; the
    same rules on the null engine, at random moments: test_durability.py):
    1. While the first run starts its engine, a second run on its folder is refused at once (exit 75).
    2. SIGTERM mid-generation: exit 143, status interrupted, the rows finished by then
       kept (they reach parts as they finish, the stop writes those waiting), its engine processes gone.
    3. The rerun runs two engine processes (--data-parallel-size 2, started beside the tokenizer's load);
       worker 1 is SIGKILLed once it runs and a part is written: its rows in flight go to worker 0, the run
       goes on. Then the CLI is SIGKILLed alone (not its process group) mid-generation: every process it
       started dies with it (the reaper), the parts it wrote stay whole, no row twice.
    4. The next rerun completes: every row once, in input order; on stderr only qbatch's lines (vLLM's go
       to OUT_DIR/engine.log, appended by every run) and an engine stopped without being killed.
    Every run has a temp folder of its own: at the end it holds nothing of qbatch's or vLLM's (sockets)."""
    inp, args = job
    out = tmp_path / "out"
    command = [sys.executable, "-m", "qbatch.cli", "run", str(inp), "-o", str(out)]
    temp = Path(tempfile.mkdtemp(prefix="qb", dir="/tmp"))  # short: a socket's path is at most 107 characters
    env = {"TMPDIR": str(temp)}

    # 1 and 2
    run = Run([str(inp), "-o", str(out), *args], env=env)
    deadline = time.monotonic() + 120
    while not (out / ".qbatch.lock").exists() and time.monotonic() < deadline:  # the first run holds the folder
        time.sleep(0.05)
    second = subprocess.run([*command, *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == EXIT_LOCKED, second.stderr
    assert "another qbatch run is using this output folder" in second.stderr
    run.wait_for_parts(out)
    assert run.engine_processes(), "the engine runs in a process of its own"
    before = _part_ids(out)
    run.proc.send_signal(signal.SIGTERM)
    run.proc.wait(timeout=60)
    stderr = "".join(run.stderr)
    assert run.proc.returncode == EXIT_SIGTERM, stderr
    assert "Error: interrupted by SIGTERM" in stderr and "rerun the same command to resume" in stderr
    assert "Traceback" not in stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["runs"][-1]["interrupted_by"] == "SIGTERM"
    assert run.survivors_after(15) == []
    kept = _part_ids(out)
    assert set(before) <= set(kept) and len(kept) == len(set(kept)) and 0 < len(kept) < len(ROWS), stderr

    # 3
    parts = _num_parts(out)
    run = Run([str(inp), "-o", str(out), *args, "--data-parallel-size", "2"], env=env)
    deadline = time.monotonic() + 300
    killed = False
    while time.monotonic() < deadline and run.proc.poll() is None and not killed:
        running = any("engine worker 1 (device 1) ready" in line for line in list(run.stderr))
        if running and _num_parts(out) > parts:
            killed = _kill_worker(run.proc.pid, "qbatch::dp-worker-1")
        time.sleep(0.1)
    assert killed, "".join(run.stderr)  # the rest is long enough for worker 1 to run before it ends
    while time.monotonic() < deadline and run.proc.poll() is None \
            and not any("engine worker 1 (device 1) died" in line for line in list(run.stderr)):
        time.sleep(0.1)
    run.wait_for_parts(out, more_than=_num_parts(out))  # worker 0 goes on alone
    run.proc.kill()
    run.proc.wait(timeout=30)
    stderr = "".join(run.stderr)
    assert run.survivors_after(GONE_WITHIN_S) == [], stderr
    assert "warning: engine worker 1 (device 1) died" in stderr
    assert "before the setup ended" in stderr  # the workers started beside the tokenizer's load
    done = _part_ids(out)
    assert set(kept) < set(done) and len(done) == len(set(done)) and len(done) < len(ROWS), stderr

    # 4
    user_env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_LOGGING", "QBATCH_VERBOSE"))} | env
    # max_num_seqs sizes the engine, not the results: the last run finishes the rest 32 rows at a time
    wide = _set(_set(args, "--max-num-seqs", "32"), "--progress", "none")
    earlier = (out / "engine.log").stat().st_size  # what the stopped runs logged, their processes all gone
    final = subprocess.run([*command, *wide], cwd=ROOT, env=user_env,
                           capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["rows_skipped"], stats["rows_ok"]) == (len(done), len(ROWS) - len(done))
    assert sum(chunk["rows"] for chunk in stats["chunks"]) == len(ROWS) - len(done)  # the rest, each row in one chunk
    results = pl.read_parquet(out / "results.parquet")
    assert results["id"].to_list() == [r["id"] for r in ROWS] and (results["completion_tokens"] == 32).all()
    assert not list(out.rglob("*.tmp-*"))
    lines = final.stderr.splitlines()
    assert len(lines) <= 5 and all(line.startswith("qbatch ") for line in lines), final.stderr
    assert "qbatch run completed" in final.stdout
    logged = (out / "engine.log").read_bytes()
    assert logged.count(b"Loading safetensors checkpoint shards") >= 3  # every run's engine, appended
    assert b"raw prompts to InputProcessor is deprecated" not in logged  # rows reach vLLM as its engine inputs
    # The last run's engine stopped cleanly. (The processes killed before may leave shared memory that
    # Python's resource tracker reports in the log as it cleans it up, once they are gone.)
    last = logged[earlier:].decode(errors="replace")
    assert "force killing" not in last and "leaked shared_memory" not in last + final.stderr, last
    assert re.search(r"\[shutdown\] MPClient: complete", last), "the engine was shut down by qbatch"
    # the killed run's folder went with the last run's start; torch's compile cache stays, as meant, and so
    # may vLLM's torch store file of the engine core killed with its worker (vLLM's own, made in the temp folder)
    assert [p.name for p in temp.iterdir() if not p.name.startswith(("torchinductor_", "vllm_dist_"))] == []
    shutil.rmtree(temp)


@pytest.mark.slow
def test_the_python_api_leaves_no_engine_at_interpreter_exit(job, tmp_path):
    inp, args = job
    flat = {"inputs": [str(inp)], "output_dir": str(tmp_path / "out"), "model": args[1], "max_model_len": 512,
            "thinking": False, "max_tokens": 4, "limit": 8, "progress": "none"}
    code = ("from qbatch.engines.pool import EnginePool; from qbatch.jobs.runner import run; "
            "from qbatch.spec import JobSpec; pool = EnginePool(); "  # left open: it closes at exit
            f"print(run(JobSpec.from_flat({flat!r}, source='test'), pool).rows_ok)")
    run = Run([], cmd=[sys.executable, "-c", code])
    run.proc.wait(timeout=600)
    survivors = run.survivors_after(15)
    assert run.proc.returncode == 0, "".join(run.stderr)
    assert "8" in run.proc.stdout.read().splitlines()  # among vLLM's log lines
    assert survivors == []


# The fast tests below use the null engine, or a stand-in engine that runs a child process the way
# vLLM's engine core is one: no model loads.

STAND_IN = '''
import subprocess, sys, time
from qbatch.engines.base import NullEngine
from qbatch.engines.pool import EnginePool

class StandIn(NullEngine):
    """Finishes two chunks, then hangs in a step, with a child process as its engine core."""

    def __init__(self, *args):
        self.core = subprocess.Popen(["sleep", "300"])

    def run(self, chunks):
        for n, done in enumerate(super().run(chunks)):
            if n == 2:
                print("generating", file=sys.stderr, flush=True)
                time.sleep(300)
            yield done

    def close(self):
        time.sleep(30)  # a shutdown that takes too long: the grace ends it

from qbatch.cli import main
main(EnginePool(start=lambda *args, **kwargs: StandIn()), close_pool=True)
'''


@pytest.fixture
def small_run(write_jsonl, bundled_model, tmp_path) -> list[str]:
    path = write_jsonl([{"id": i, "prompt": f"prompt {i} " * 5} for i in range(40)])
    return ["run", str(path), "-o", str(tmp_path / "out"), "--model", bundled_model, "--backend", "null",
            "--chunk-tokens", "300", "--max-tokens", "4", "--progress", "none"]


class _Unhandled(Exception):
    pass


@pytest.fixture
def sigterm_raises():
    """SIGTERM in this test process raises _Unhandled, unless the code under test handles it."""

    def handler(signum, frame):
        raise _Unhandled("SIGTERM reached the test's own handler")

    previous = signal.signal(signal.SIGTERM, handler)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_in_process_marks_the_run_interrupted_and_the_rerun_completes(cli, small_run, tmp_path,
                                                                                sigterm_raises):
    from qbatch.engines.base import NullEngine
    from qbatch.engines.pool import EnginePool

    class Terminated(NullEngine):
        def run(self, chunks):
            for n, done in enumerate(super().run(chunks)):
                if n == 2:
                    os.kill(os.getpid(), signal.SIGTERM)
                yield done

    out = tmp_path / "out"
    result = cli(*small_run, pool=EnginePool(start=lambda *a, **k: Terminated()))
    assert result.exit_code == EXIT_SIGTERM
    assert result.stderr.startswith(f"Error: interrupted by SIGTERM ({out}): finished parts are kept, "
                                    "rows in flight are redone on resume\nHint: rerun the same command to resume")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["runs"][-1]["interrupted_by"] == "SIGTERM"
    assert list((out / "parts").glob("part-*.parquet"))
    assert signal.getsignal(signal.SIGTERM).__name__ == "handler"  # the caller's handler is back
    result = cli(*small_run)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == [str(i) for i in range(40)]


@pytest.mark.parametrize("signals", [1, 2], ids=["one-signal", "second-signal"])
def test_a_signal_kills_the_engine_processes_and_a_second_one_exits_at_once(small_run, tmp_path, signals):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr_file:  # a file: the stand-in's core holds no pipe open after the run
        proc = subprocess.Popen([sys.executable, str(script), *small_run], cwd=ROOT, stderr=stderr_file,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    deadline = time.monotonic() + 120
    while "generating" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    core = psutil.Process(proc.pid).children()[0]
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    if signals == 2:  # while the engines shut down (the first signal's stop is recorded and said by then)
        while "Error: interrupted" not in log.read_text() and time.monotonic() < started + 10:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()  # from the second signal on
    try:
        proc.wait(timeout=30)
    finally:
        took = time.monotonic() - started
        kill_later = [core] if _alive(core) else []
        psutil.wait_procs(kill_later, timeout=5)
        alive = _alive(core)
        if alive:
            core.kill()
    stderr = log.read_text()
    assert proc.returncode == EXIT_SIGTERM, stderr
    assert "Error: interrupted by SIGTERM" in stderr and "Traceback" not in stderr
    if signals == 2:
        assert "qbatch: SIGTERM again: killing the engines and exiting now" in stderr
        assert took < 2.5  # after the second signal: not the grace the first one gives the engines
    else:
        assert took < 10  # close() would take 30 s: the grace ends it
    assert not alive


def test_the_reaper_kills_what_a_dead_process_leaves(tmp_path):
    """A child's death takes its descendants along (an engine core under a dead worker); the watched
    process's death takes all of them."""
    from qbatch.jobs.shutdown import start_reaper

    tree = ("import subprocess, sys, time\n"
            "sys.stdout.write('%d\\n' % subprocess.Popen(['sleep', '300']).pid)\n"
            "child = subprocess.Popen([sys.executable, '-c', "
            "'import subprocess, sys, time; print(subprocess.Popen([\"sleep\", \"300\"]).pid, flush=True); time.sleep(300)'],"
            " stdout=sys.stdout)\n"
            "sys.stdout.flush(); time.sleep(300)\n")
    watched = subprocess.Popen([sys.executable, "-c", tree], stdout=subprocess.PIPE, text=True, start_new_session=True)
    direct, grandchild = (psutil.Process(int(watched.stdout.readline())) for _ in range(2))
    child = grandchild.parent()
    reaper = start_reaper(watched.pid)
    time.sleep(1.5)  # the reaper has seen the tree
    try:
        child.kill()
        psutil.wait_procs([grandchild], timeout=6)
        assert not _alive(grandchild) and _alive(direct)
        watched.kill()
        psutil.wait_procs([direct], timeout=6)
        assert not _alive(direct)
        reaper.wait(timeout=6)
    finally:
        for process in (direct, grandchild, child):
            if _alive(process):
                process.kill()
        watched.kill()


def test_a_process_killed_outright_takes_what_it_started_along(tmp_path):
    """The CLI's case: the reaper is a child of the process it watches."""
    script = ("import subprocess, sys, time\n"
              f"sys.path.insert(0, {str(ROOT)!r})\n"
              "from qbatch.jobs.runtime import this_process\n"
              "from qbatch.jobs.shutdown import ProcessGuard\n"
              "with this_process().start(reaper=True) as runtime, ProcessGuard(reaper=runtime.reaper):\n"
              "    print(subprocess.Popen(['sleep', '300']).pid, flush=True)\n"
              "    time.sleep(300)\n")
    watched = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    engine = psutil.Process(int(watched.stdout.readline()))
    time.sleep(1.5)  # the reaper has seen it
    watched.kill()
    watched.wait()
    psutil.wait_procs([engine], timeout=6)
    alive = _alive(engine)
    if alive:
        engine.kill()
    assert not alive


SLOW_CLOSE = '''
import subprocess, sys, time
from qbatch.engines.base import NullEngine
from qbatch.engines.pool import EnginePool

class SlowClose(NullEngine):
    """Generates at once, with a child process as its engine core; its shutdown takes 30 s."""

    def __init__(self, *args):
        self.core = subprocess.Popen(["sleep", "300"])

    def close(self):
        print("closing", file=sys.stderr, flush=True)
        time.sleep(30)

from qbatch.cli import main
main(EnginePool(start=lambda *args, **kwargs: SlowClose()), close_pool=True)
'''


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_shutdown_of_a_completed_run_says_it_completed(small_run, tmp_path, signum):
    script = tmp_path / "slow_close.py"
    script.write_text(SLOW_CLOSE)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr_file:
        proc = subprocess.Popen([sys.executable, str(script), *small_run, "--fail-on-row-errors"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=stderr_file, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    deadline = time.monotonic() + 120
    while "closing" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    core = psutil.Process(proc.pid).children()[0]
    started = time.monotonic()
    proc.send_signal(signum)
    try:
        stdout, _ = proc.communicate(timeout=30)
    finally:
        took = time.monotonic() - started
        alive = _alive(core) and not psutil.wait_procs([core], timeout=5)[0]
        if _alive(core):
            core.kill()
    stderr = log.read_text()
    assert proc.returncode == 0, stderr
    assert "Error" not in stderr and "Traceback" not in stderr
    assert f"qbatch: {signum.name} after the run completed (its results are written): stopping the engines now" \
        in stderr
    assert "results" in stdout and took < 20 and not alive  # the summary; the 30 s shutdown was cut short
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "completed"
