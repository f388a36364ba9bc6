"""Airflow DAGs that run a qbatch job every night, with what a production DAG needs.

- `execution_timeout`: Airflow stops a task that runs too long by sending SIGTERM to its
  command. qbatch keeps its finished parts, marks the run `interrupted` and exits 143; the task
  fails, and its retry runs the same command, which resumes where the stopped attempt ended.
- `retries`: cheap for that reason. A retry that starts while an old attempt still holds the
  output folder exits 75 at once (and is retried later).
- Rows that fail (a prompt too long, a bad value) do not fail the run: they are recorded with
  their reason. `check_errors` fails the DAG run, without retries, when `qbatch status --json`
  counts any (or pass `--fail-on-row-errors` to `qbatch run`: exit 4).
- `report` writes OUT_DIR/report.html: throughput, GPU use, lengths, errors.

`qbatch_nightly` runs Qwen3-0.6B on a GPU worker; `qbatch_local` is the same DAG on the bundled
model and the sample prompts, to try offline: `airflow dags test qbatch_local 2026-01-01`.
`qbatch_sharded` fans a job out over N workers without Ray, then merges.
"""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime, timedelta
from pathlib import Path

from airflow import DAG
from airflow.exceptions import AirflowFailException
from airflow.operators.bash import BashOperator
from airflow.operators.python import PythonOperator

JOBS = Path(__file__).resolve().parent  # this folder: the job files beside this DAG
DAG_ARGS = dict(start_date=datetime(2026, 1, 1), schedule="@daily", catchup=False,
                default_args={"retries": 3, "retry_delay": timedelta(minutes=5)})


def check_errors(output_dir: str) -> None:
    """Fail (no retry: rerunning would not change the rows) when any row of the job failed."""
    status = json.loads(subprocess.run(["qbatch", "status", output_dir, "--json"], check=True,
                                       capture_output=True, text=True).stdout)
    if status["rows_failed"]:
        raise AirflowFailException(f"{status['rows_failed']} of {status['rows_total']} rows failed: "
                                   f"their reasons are in {output_dir}/errors.parquet")


def qbatch_dag(dag_id: str, *, job: str, inputs: str, output_dir: str, timeout: timedelta) -> DAG:
    """generate >> [report, check_errors]: one qbatch job a day into its own output folder."""
    with DAG(dag_id=dag_id, **DAG_ARGS) as dag:
        generate = BashOperator(
            task_id="generate",
            # Log lines (not a progress bar) go to the task log; the summary goes to stdout.
            bash_command=f"qbatch run --job {job} {inputs} -o {output_dir} --progress log",
            execution_timeout=timeout,
        )
        report = BashOperator(task_id="report", bash_command=f"qbatch report {output_dir}")
        check = PythonOperator(task_id="check_errors", python_callable=check_errors, op_args=[output_dir],
                               retries=0)
        generate >> [report, check]
    return dag


nightly = qbatch_dag("qbatch_nightly", job="/opt/jobs/qwen3_0.6b.toml", inputs="/data/prompts/{{ ds }}/*.jsonl",
                     output_dir="/data/results/{{ ds }}", timeout=timedelta(hours=6))

local = qbatch_dag("qbatch_local", job=f"{JOBS}/quickstart.toml", inputs="",
                   output_dir=os.environ.get("QBATCH_LOCAL_OUT", "/tmp/qbatch-local") + "/{{ ds }}",
                   timeout=timedelta(minutes=30))

# Fan-out without Ray: N mapped copies each process a stable slice of the rows
# (`--shard I/N`, by id hash), then `qbatch merge` combines them and refuses
# shards of different jobs, incomplete shards and missing or repeated ones.
SHARDS = 4
with DAG(dag_id="qbatch_sharded", **DAG_ARGS) as sharded:
    shard_runs = BashOperator.partial(task_id="generate_shard", execution_timeout=timedelta(hours=6)).expand(
        bash_command=[
            "qbatch run --job /opt/jobs/qwen3_0.6b.toml /data/prompts/{{ ds }}/*.jsonl "
            f"--shard {i}/{SHARDS} -o /data/results/{{{{ ds }}}}/shard-{i} --progress log"
            for i in range(SHARDS)
        ]
    )
    merge = BashOperator(
        task_id="merge",
        bash_command="qbatch merge /data/results/{{ ds }}/shard-* -o /data/results/{{ ds }}/all",
    )
    shard_runs >> merge
