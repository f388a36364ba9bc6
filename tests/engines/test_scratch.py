"""A run's temporary engine files (vLLM's sockets among them) live in one folder that goes with the run.

A real run leaving its temp folder as it found it, killed or not: tests/jobs/test_signals.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from qbatch.engines import scratch


@pytest.fixture
def temp(monkeypatch):
    """An empty temp folder (of a short path, as /tmp's), no folder made yet, and the exit handlers
    recorded instead of registered."""
    tmp_path = Path(tempfile.mkdtemp(prefix="qb", dir="/tmp"))
    monkeypatch.setattr(scratch.tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(scratch.SCRATCH_ENV, raising=False)
    monkeypatch.delenv(scratch.SOCKETS_ENV, raising=False)
    at_exit: list[tuple] = []
    monkeypatch.setattr(scratch.atexit, "register", lambda *call: at_exit.append(call))
    yield tmp_path, at_exit
    shutil.rmtree(tmp_path)


def test_the_first_engine_makes_the_folder_and_points_vllms_sockets_there(temp):
    tmp, at_exit = temp
    folder = scratch.scratch_folder()
    assert os.path.dirname(folder) == str(tmp) and os.path.basename(folder).startswith(f"qbatch-{os.getpid()}-")
    assert os.environ[scratch.SOCKETS_ENV] == os.environ[scratch.SCRATCH_ENV] == folder
    assert scratch.scratch_folder() == folder  # the next engine shares it
    assert len(at_exit) == 1
    func, *args = at_exit[0]
    func(*args)  # what exit does: the folder goes, sockets and all
    assert list(tmp.iterdir()) == []


def test_an_engine_process_inherits_its_parents_folder(temp):
    tmp, at_exit = temp
    folder = scratch.scratch_folder()
    child = subprocess.run([sys.executable, "-c", "from qbatch.engines.scratch import scratch_folder; print(scratch_folder())"],
                           capture_output=True, text=True, check=True, env={**os.environ, "TMPDIR": str(tmp)})
    assert child.stdout.strip() == folder
    assert [p.name for p in tmp.iterdir()] == [os.path.basename(folder)]


def test_a_folder_that_is_not_on_this_machine_is_replaced(temp, monkeypatch):
    """A Ray actor on another machine inherits the driver's setting, not its folder."""
    tmp, _ = temp
    monkeypatch.setenv(scratch.SCRATCH_ENV, str(tmp / "elsewhere"))
    monkeypatch.setenv(scratch.SOCKETS_ENV, str(tmp / "elsewhere"))
    folder = scratch.scratch_folder()
    assert os.path.isdir(folder) and os.environ[scratch.SOCKETS_ENV] == folder


def test_a_socket_folder_the_user_set_is_kept(temp, monkeypatch):
    tmp, _ = temp
    monkeypatch.setenv(scratch.SOCKETS_ENV, "/run/mine")
    folder = scratch.scratch_folder()
    assert os.environ[scratch.SOCKETS_ENV] == "/run/mine" and os.path.isdir(folder)


def test_the_folder_of_a_killed_run_goes_with_the_next_start(temp):
    tmp, _ = temp
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp / f"qbatch-{gone.stdout.strip()}-abc"
    (dead / "qbatch-engine-start-x").mkdir(parents=True)
    (dead / "5f0c1e2a-socket").touch()
    living = tmp / f"qbatch-{os.getppid()}-def"  # a run still going (here: pytest's parent)
    living.mkdir()
    other = tmp / "qbatch-engine-start-x"  # not a folder of this kind
    other.mkdir()
    folder = scratch.scratch_folder()
    assert sorted(p.name for p in tmp.iterdir()) == sorted([living.name, other.name, os.path.basename(folder)])


def test_sockets_stay_where_vllm_puts_them_when_the_path_would_be_too_long(temp, monkeypatch):
    """A socket's path has a length limit (107 characters on Linux): vLLM would fail to start."""
    tmp, _ = temp
    deep = tmp / ("d" * (scratch.SOCKET_PATH_MAX - len(str(tmp)) - 1 - scratch.SOCKET_NAME - 1))
    deep.mkdir()
    monkeypatch.setattr(scratch.tempfile, "tempdir", str(deep))
    folder = scratch.scratch_folder()
    assert os.path.isdir(folder) and scratch.SOCKETS_ENV not in os.environ
    assert len(str(deep)) + 1 + scratch.SOCKET_NAME <= scratch.SOCKET_PATH_MAX  # vLLM's own place still fits

