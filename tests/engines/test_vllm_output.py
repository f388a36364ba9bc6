"""vLLM's own output goes to the engine log, not the terminal: its log records, its processes' prints;
-v shows it; a failing engine shows the log's last lines; engine processes end promptly.

The fast tests stand in for vLLM's engine processes with processes of their own, started the way vLLM
starts them (multiprocessing, spawned or forked); what a real CLI run shows: tests/jobs/test_signals.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qbatch.engines import vllm_output
from qbatch.engines.vllm_output import EngineLog, engine_processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def quiet(monkeypatch, tmp_path):
    """vLLM's output routed to tmp_path/engine.log, as by a run; the process's setting put back after."""
    for name in (vllm_output.VERBOSE_ENV, *vllm_output.USER_LOGGING_ENVS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(vllm_output.STREAM_ENV, vllm_output.STREAM)
    before = vllm_output.current()
    path = tmp_path / "engine.log"
    vllm_output.use(path)
    yield path
    vllm_output.ROUTING.target = before


def _engine_process(text: str, code: int) -> None:
    """What a vLLM engine process does: prints from C and Python, logs before its logging is set up, sets
    it up as vLLM does (a handler on the stream VLLM_LOGGING_STREAM names), logs, exits."""
    import logging.config
    import warnings

    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # a forked one came with pytest's capture
    os.write(2, f"fd2: {text}\n".encode())  # C/C++ code and torch write to the file descriptor
    print(f"stdout: {text}")
    warnings.warn(f"warning: {text}")  # Python's warnings: sys.stderr
    logging.getLogger("vllm.early").warning("early: %s", text)  # at vLLM's import, before it sets up logging
    logging.config.dictConfig({
        "version": 1, "disable_existing_loggers": False,
        "handlers": {"vllm": {"class": "logging.StreamHandler", "stream": os.environ["VLLM_LOGGING_STREAM"]}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}}})
    logging.getLogger("vllm.engine").info("log: %s", text)
    import atexit

    atexit.register(os.write, 2, b"the interpreter's teardown ran\n")
    sys.exit(code)


def _start(context: str, text: str, code: int = 0) -> mp.process.BaseProcess:
    with engine_processes():
        process = mp.get_context(context).Process(target=_engine_process, args=(text, code))
        process.start()
    return process


@pytest.mark.parametrize("context", ["spawn", "fork"])
def test_an_engine_processs_output_goes_to_the_engine_log_not_the_terminal(quiet, capfd, context):
    process = _start(context, f"hello from {context}", code=3)
    process.join(60)
    assert process.exitcode == 3  # its exit code, as multiprocessing gives it
    assert capfd.readouterr().err == ""
    logged = quiet.read_text()
    # (pytest records the warnings of a process it forked, with its own capture)
    for source in ("fd2", "stdout", "early", "log", *(["warning"] if context == "spawn" else [])):
        assert f"{source}: hello from {context}" in logged
    # it ends as a forked child does: no interpreter teardown (seconds with vLLM loaded)
    assert "the interpreter's teardown ran" not in logged


def test_processes_started_outside_an_engine_start_keep_the_terminal(quiet, capfd):
    process = mp.get_context("spawn").Process(target=_engine_process, args=("not an engine", 0))
    process.start()
    process.join(60)
    assert "fd2: not an engine" in capfd.readouterr().err
    assert not quiet.exists() or "not an engine" not in quiet.read_text()


def test_verbose_leaves_vllms_output_on_the_terminal(quiet, capfd, monkeypatch):
    monkeypatch.setenv(vllm_output.VERBOSE_ENV, "1")
    vllm_output.use(quiet)
    assert vllm_output.current() is None
    process = _start("spawn", "shown")
    process.join(60)
    assert "fd2: shown" in capfd.readouterr().err


def test_a_logging_setup_of_the_users_own_is_left_alone(quiet, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "/somewhere/logging.json")
    vllm_output.use(quiet)
    assert vllm_output.current() is None


def test_vllms_records_in_this_process_go_to_the_engine_log(quiet, capfd):
    """vLLM configures its logging with the stream qbatch names (VLLM_LOGGING_STREAM), as vLLM does it."""
    pytest.importorskip("vllm.logger")
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging, init_logger

    configure_logging(LoggingConfig(log_level="INFO", configure_logging=True, pylogging_config_file=None))
    init_logger("vllm.test").info("a record of vLLM's")
    assert "a record of vLLM's" in quiet.read_text()
    assert "a record of vLLM's" not in capfd.readouterr().err


def test_the_tail_is_the_engines_last_lines_since_its_start(tmp_path, engine_log):
    path = tmp_path / "engine.log"
    path.write_text("an earlier run's line\n")
    log = EngineLog(path, path.stat().st_size)
    with open(path, "a") as handle:
        handle.write("".join(f"line {i}\n" for i in range(30)))
        handle.write("\rLoading: 0%\rLoading: 100%\n")  # a tqdm bar: its last state
    assert log.tail() == [*(f"line {i}" for i in range(11, 30)), "Loading: 100%"]
    log.show_tail()
    record = next(r for r in engine_log.records if r.name == "qbatch")
    assert record.levelname == "ERROR"
    assert record.getMessage().startswith(f"vLLM's last 20 lines ({path}):\n  line 11\n")
    assert EngineLog(None).tail() == [] and EngineLog(tmp_path / "none.log").tail() == []


def test_session_logs_are_kept_to_the_newest(tmp_path):
    for i in range(vllm_output.KEPT_SESSION_LOGS + 3):
        old = tmp_path / f"session-{i:03d}.log"
        old.write_text("")
        os.utime(old, (1000 + i, 1000 + i))
    path = vllm_output.fresh_session_log(tmp_path)
    path.write_text("")
    kept = sorted(p.name for p in tmp_path.glob("session-*.log"))
    assert len(kept) == vllm_output.KEPT_SESSION_LOGS and path.name in kept and "session-000.log" not in kept


def test_shutdown_gives_the_engine_time_to_stop_cleanly():
    from qbatch.engines.vllm import SHUTDOWN_S, shutdown_llm

    calls = []

    class Client:
        def shutdown(self, timeout=None):  # vLLM 0.32: 5 s unless told
            calls.append(timeout)

    class OldClient:
        def shutdown(self):  # vLLM 0.2x
            calls.append("no timeout")

    for client in (Client(), OldClient()):
        shutdown_llm(type("LLM", (), {"llm_engine": type("E", (), {"engine_core": client})()})())
    assert calls == [SHUTDOWN_S, "no timeout"]


def test_verbose_flag_is_on_the_commands_that_start_engines(monkeypatch):
    from qbatch.cli import cli

    monkeypatch.delenv(vllm_output.VERBOSE_ENV, raising=False)
    for name in ("run", "embed", "serve", "bench"):
        [option] = [p for p in cli.commands[name].params if "--verbose" in p.opts]
        assert option.count and "-v" in option.opts
    ctx = cli.commands["run"].make_context("run", ["-vv", "in.jsonl"])
    assert os.environ[vllm_output.VERBOSE_ENV] == "2" and "verbose" not in ctx.params  # no job setting


def test_the_cli_ends_without_the_interpreters_teardown_once_vllm_is_loaded(tmp_path):
    """Exit hooks run, output is flushed, the exit code is the command's."""
    code = ("import atexit, sys, types; sys.modules['vllm'] = types.ModuleType('vllm'); "
            "atexit.register(lambda: print('hook ran', flush=True)); "
            "sys.argv = ['qbatch', 'status', sys.argv[1]]; from qbatch.cli import main; main()")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing")], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr  # click's usage error: no such folder
    assert "does not exist" in result.stderr and result.stdout == "hook ran\n"
