"""The process's engine machinery owned by one Runtime (jobs/runtime.py): start and stop may be called
again, and stop puts back what start changed (vLLM's stream setting, its early handler, the reaper)."""

from __future__ import annotations

import logging
import os

import psutil
import pytest

from qbatch.engines import mps, vllm_output
from qbatch.jobs.runtime import Runtime, this_process


@pytest.fixture
def clean(monkeypatch):
    """No engine log routed, no stream named, vLLM's logger without handlers: what a fresh process has."""
    for name in (vllm_output.STREAM_ENV, vllm_output.VERBOSE_ENV, *vllm_output.USER_LOGGING_ENVS):
        monkeypatch.delenv(name, raising=False)
    vllm = logging.getLogger("vllm")
    monkeypatch.setattr(vllm, "handlers", [])
    # propagating, as before vLLM configures it: pytest attaches its capture handlers to every logger that
    # does not propagate (vLLM's, once a test of this worker configured it) when a test's call starts
    monkeypatch.setattr(vllm, "propagate", True)
    before = vllm_output.ROUTING.target
    vllm_output.ROUTING.stop()
    yield vllm
    vllm_output.ROUTING.target = before


def test_stop_puts_back_what_start_changed_and_both_may_be_called_again(clean, tmp_path):
    runtime = Runtime()
    runtime.start(engine_log=tmp_path / "engine.log", reaper=True)
    reaper = runtime.reaper
    assert reaper is not None and psutil.pid_exists(reaper.pid)
    assert runtime.engine_log == vllm_output.current() == tmp_path / "engine.log"
    assert os.environ[vllm_output.STREAM_ENV] == vllm_output.STREAM and len(clean.handlers) == 1
    assert runtime.start(reaper=True).reaper is reaper  # one reaper a process, however many starts
    assert len(clean.handlers) == 1

    runtime.stop()
    assert reaper.poll() is not None and runtime.reaper is None and not runtime.started
    assert vllm_output.current() is None and vllm_output.STREAM_ENV not in os.environ and clean.handlers == []
    runtime.stop()  # again: nothing to do
    assert vllm_output.current() is None and vllm_output.STREAM_ENV not in os.environ


def test_a_stream_the_user_named_stays_after_stop(clean, tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_output.STREAM_ENV, vllm_output.STREAM)  # set before qbatch ran: not the runtime's
    with Runtime().start(engine_log=tmp_path / "engine.log"):
        pass
    assert os.environ[vllm_output.STREAM_ENV] == vllm_output.STREAM


def test_stop_quits_an_mps_daemon_left_running_and_the_process_has_one_runtime(monkeypatch):
    stopped = []

    class Daemon:
        def stop(self):
            stopped.append(self)

    daemon = Daemon()
    monkeypatch.setattr(mps.SHARE, "_daemon", daemon)
    monkeypatch.setattr(mps.SHARE, "_users", 1)
    Runtime().stop()
    Runtime().stop()
    assert stopped == [daemon] and mps.SHARE._daemon is None
    assert this_process() is this_process()
