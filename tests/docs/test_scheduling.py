"""The scheduling examples do what the docs say: the Airflow DAGs' commands run (the offline DAG on
the null engine), check_errors fails a run with failed rows, and the cron wrapper maps qbatch's exit
codes (4: rows failed, 75: another run holds the folder)."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import types
from datetime import timedelta
from pathlib import Path

import pytest

from harness import ROOT, check, qbatch_bin, qbatch_invocations, run_command

DAG_FILE = ROOT / "jobs" / "airflow_dag.py"
CRON = ROOT / "jobs" / "qbatch_cron.sh"
DS = "2026-01-01"


class AirflowFailException(Exception):
    pass


class Task:
    """Airflow's operators as far as the DAG file uses them: arguments kept, `>>` recorded."""

    def __init__(self, task_id: str, **kwargs) -> None:
        self.task_id, self.kwargs, self.downstream = task_id, kwargs, []
        DAG.current.tasks[task_id] = self

    def __rshift__(self, other):
        self.downstream += [t.task_id for t in (other if isinstance(other, list) else [other])]
        return other

    def __rrshift__(self, others):
        for task in others:
            task >> self
        return self

    @classmethod
    def partial(cls, task_id: str, **kwargs):
        return types.SimpleNamespace(expand=lambda **mapped: cls(task_id, **kwargs, **mapped))


class DAG:
    current: DAG

    def __init__(self, dag_id: str, **kwargs) -> None:
        self.dag_id, self.kwargs, self.tasks = dag_id, kwargs, {}

    def __enter__(self) -> DAG:
        DAG.current = self
        return self

    def __exit__(self, *exc) -> None:
        pass


@pytest.fixture
def dags(monkeypatch, tmp_path) -> dict[str, DAG]:
    """jobs/airflow_dag.py imported with Airflow's classes stood in for; its DAGs by id."""
    modules = {"airflow": {"DAG": DAG}, "airflow.exceptions": {"AirflowFailException": AirflowFailException},
               "airflow.operators": {}, "airflow.operators.bash": {"BashOperator": type("BashOperator", (Task,), {})},
               "airflow.operators.python": {"PythonOperator": type("PythonOperator", (Task,), {})}}
    for name, attributes in modules.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attributes))
    monkeypatch.setenv("QBATCH_LOCAL_OUT", str(tmp_path / "local"))
    monkeypatch.setenv("PATH", f"{qbatch_bin(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}")
    spec = importlib.util.spec_from_file_location("airflow_dag", DAG_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {value.dag_id: value for value in vars(module).values() if isinstance(value, DAG)}


def _rendered(text: str) -> str:
    return text.replace("{{ ds }}", DS)


def test_the_production_dags_have_what_the_docs_promise(dags):
    nightly = dags["qbatch_nightly"]
    generate = nightly.tasks["generate"]
    assert generate.kwargs["execution_timeout"] == timedelta(hours=6)
    assert nightly.kwargs["default_args"]["retries"] == 3
    assert sorted(generate.downstream) == ["check_errors", "report"]
    assert nightly.tasks["report"].kwargs["bash_command"].startswith("qbatch report ")
    assert nightly.tasks["check_errors"].kwargs["retries"] == 0
    assert "execution_timeout" in dags["qbatch_sharded"].tasks["generate_shard"].kwargs
    assert dags["qbatch_sharded"].tasks["generate_shard"].downstream == ["merge"]


def test_every_dag_command_parses(dags):
    commands = [command for dag in dags.values() for task in dag.tasks.values()
                for command in ([task.kwargs["bash_command"]] if isinstance(task.kwargs.get("bash_command"), str)
                                else task.kwargs.get("bash_command", []))]
    assert len(commands) == 4 + 2 + 2 + 1  # sharded: 4 shards and merge; nightly and local: generate, report
    for command in commands:
        for args in qbatch_invocations(_rendered(command)):
            check(args)


def test_the_local_dag_runs(dags, tmp_path):
    local = dags["qbatch_local"]
    out = tmp_path / "local" / DS
    for task_id in ("generate", "report"):
        code, output = run_command(_rendered(local.tasks[task_id].kwargs["bash_command"]))
        assert code == 0, output
    assert (out / "results.parquet").exists() and (out / "report.html").exists()
    check = local.tasks["check_errors"]
    check.kwargs["python_callable"](*map(_rendered, check.kwargs["op_args"]))  # no failed row: passes


def test_check_errors_fails_a_run_with_failed_rows(dags, tmp_path, write_jsonl):
    rows = write_jsonl([{"id": "a", "prompt": "Hi"}, {"id": "b", "prompt": ""}])
    out = tmp_path / "with-errors"
    code, output = run_command(f"qbatch run {rows} -o {out} --model smollm2-135m --progress none")
    assert code == 0, output
    check = dags["qbatch_nightly"].tasks["check_errors"].kwargs["python_callable"]
    with pytest.raises(AirflowFailException, match=rf"^1 of 2 rows failed: their reasons are in {out}/errors.parquet$"):
        check(str(out))


def test_the_cron_wrapper_reports_failed_rows_and_leaves_a_busy_folder_alone(tmp_path, write_jsonl):
    out = tmp_path / "cron"
    env = {**os.environ, "PATH": f"{qbatch_bin(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}",
           "QBATCH_JOB": str(ROOT / "jobs" / "quickstart.toml"), "QBATCH_OUT": str(out),
           "QBATCH_INPUTS": str(write_jsonl([{"id": "a", "prompt": "Hi"}, {"id": "b", "prompt": " "}]))}
    run = subprocess.run(["bash", str(CRON)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 4, run.stderr
    assert f"rows failed, their reasons are in {out}/errors.parquet" in run.stderr
    assert (out / "report.html").exists()
    assert json.loads((out / "manifest.json").read_text())["status"] == "completed"

    with open(out / ".qbatch.lock", "a") as lock:  # a run still working on the folder
        fcntl.flock(lock, fcntl.LOCK_EX)
        busy = subprocess.run(["bash", str(CRON)], env=env, capture_output=True, text=True, timeout=600)
    assert busy.returncode == 0, busy.stderr
    assert f"a run still holds {out}; leaving it alone" in busy.stderr
