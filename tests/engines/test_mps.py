"""CUDA MPS for engines sharing a GPU (qbatch/engines/mps.py): the run's own daemon starts, its engines
get its folders, and it quits when the run ends, killed or not. No GPU here: a stand-in control program
that keeps the real one's contract (`-f` runs in the foreground and makes the control socket in
CUDA_MPS_PIPE_DIRECTORY; `quit` on a client's stdin ends it); the real one ran on the H200
(docs/benchmarks.md)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from qbatch.engines import mps

FAKE_CONTROL = """\
#!/bin/sh
if [ "$1" = -f ]; then
  echo $$ > "$CUDA_MPS_PIPE_DIRECTORY/daemon.pid"
  : > "$CUDA_MPS_PIPE_DIRECTORY/control"
  while [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; do sleep 0.05; done
  exit 0
fi
read command
echo "$command" >> "$CUDA_MPS_LOG_DIRECTORY/commands"
[ "$command" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
"""


@pytest.fixture
def control(tmp_path, monkeypatch):
    """The stand-in control program first on PATH, and a scratch folder of the test's own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / mps.CONTROL
    program.write_text(FAKE_CONTROL)
    program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    scratch = Path("/tmp") / f"qbmps-{os.getpid()}"
    scratch.mkdir(exist_ok=True)
    monkeypatch.setenv("QBATCH_SCRATCH", str(scratch))
    yield scratch
    mps.SHARE.stop()  # a test that failed between acquire and release
    shutil.rmtree(scratch, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running(pid)


def test_the_daemon_serves_the_runs_engines_and_quits_when_stopped(control, monkeypatch, tmp_path):
    monkeypatch.setattr(mps, "_probe", lambda daemon, devices: None)  # no GPU to make a context on
    log_path = tmp_path / "engine.log"
    daemon = mps.start(("0", "1"), log_path)
    assert daemon is not None
    env = daemon.env()
    pipe, logs = Path(env[mps.PIPE_ENV]), Path(env[mps.LOG_ENV])
    assert pipe.parent.parent == control and (pipe / "control").exists()  # in the run's scratch folder
    pid = int((pipe / "daemon.pid").read_text())
    assert _running(pid)
    daemon.stop()
    assert (logs / "commands").read_text() == "quit\n"  # its own way to stop, after the engines
    assert not _running(pid) and daemon.watcher.poll() == 0


def test_a_processs_engines_share_one_daemon_which_quits_after_the_last(control, monkeypatch):
    probed = []
    monkeypatch.setattr(mps, "_probe", lambda daemon, devices: probed.append(devices))
    generate = mps.acquire(("0",))
    embed = mps.acquire(("0", "1"))  # a Session's second engine configuration, one GPU more
    assert generate is embed and probed == [("0",), ("0", "1")]  # the new GPU checked through the running one
    pid = int((generate.folder / "pipe" / "daemon.pid").read_text())
    mps.release(generate)
    assert _running(pid)  # the other engines still use it
    mps.release(embed)
    again = mps.acquire(("0",))
    assert _gone(pid) and again is not generate  # the next engines start a new one
    mps.release(again)


def test_a_run_killed_outright_leaves_no_daemon(control, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from qbatch.engines import mps
        mps._probe = lambda daemon, devices: None
        daemon = mps.start(("0",))
        print((daemon.folder / "pipe" / "daemon.pid").read_text().strip(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert _gone(int(run.stdout)), "the daemon outlived the run that started it"


def test_where_no_cuda_context_can_be_made_through_it_the_engines_take_turns(control, caplog):
    with caplog.at_level(logging.WARNING, logger="qbatch"):
        assert mps.start(("0",)) is None  # the real check: no GPU (nor libcuda) here
    assert "CUDA MPS did not start (a CUDA context through it failed" in caplog.text
    assert "take turns" in caplog.text and "--no-mps" in caplog.text
    pids = list(control.glob("mps-*/pipe/daemon.pid"))
    assert pids and all(_gone(int(p.read_text())) for p in pids)  # the daemon it started quit


def test_without_the_control_program_the_engines_take_turns(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no NVIDIA driver's programs here
    monkeypatch.setenv("QBATCH_SCRATCH", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="qbatch"):
        assert mps.start(("0",)) is None
    assert f"CUDA MPS did not start ({mps.CONTROL} not found)" in caplog.text
    assert not list(tmp_path.iterdir())  # nothing made


def test_a_control_program_that_does_not_start_is_no_run_stopper(control, monkeypatch, caplog):
    program = Path(os.environ["PATH"].split(os.pathsep)[0]) / mps.CONTROL
    program.write_text("#!/bin/sh\nexit 1\n")  # fails at once, as a daemon refused by the system would
    monkeypatch.setattr(mps, "START_TIMEOUT_S", 1.0)
    with caplog.at_level(logging.WARNING, logger="qbatch"):
        assert mps.start(("0",)) is None
    assert f"CUDA MPS did not start ({mps.CONTROL} did not listen)" in caplog.text
