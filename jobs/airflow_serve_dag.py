"""An Airflow DAG that submits a night's prompts to a running `qbatch serve` and waits for the results.

The service keeps the engine warm (no ~30 s engine start per task) and its queue survives restarts,
so this task only talks OpenAI's Batch API with the `openai` client: upload, create, poll, download.
A retried task finds the batch it already created (by its metadata) instead of submitting twice.
Set QBATCH_SERVE_URL (e.g. http://gpu-host:8000/v1) and QBATCH_API_KEY in the worker's environment.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta

from airflow import DAG
from airflow.operators.python import PythonOperator

POLL_S = 30
TERMINAL = ("completed", "failed", "expired", "cancelled")


def submit_and_wait(ds: str, **_: object) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=os.environ.get("QBATCH_SERVE_URL", "http://127.0.0.1:8000/v1"),
                    api_key=os.environ.get("QBATCH_API_KEY", "unused"))
    batch = next((b for b in client.batches.list(limit=100) if (b.metadata or {}).get("ds") == ds
                  and b.status not in ("failed", "cancelled", "expired")), None)
    if batch is None:
        with open(f"/data/prompts/{ds}/batch.jsonl", "rb") as handle:
            file = client.files.create(file=handle, purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"ds": ds, "dag": "qbatch_serve_nightly"})
    while batch.status not in TERMINAL:
        time.sleep(POLL_S)
        batch = client.batches.retrieve(batch.id)
    if batch.status != "completed":
        raise RuntimeError(f"batch {batch.id} ended {batch.status}: {batch.errors}")
    out = f"/data/results/{ds}"
    os.makedirs(out, exist_ok=True)
    client.files.content(batch.output_file_id).write_to_file(f"{out}/output.jsonl")
    if batch.error_file_id:
        client.files.content(batch.error_file_id).write_to_file(f"{out}/errors.jsonl")
    return batch.id


with DAG(dag_id="qbatch_serve_nightly", start_date=datetime(2026, 1, 1), schedule="@daily", catchup=False,
         default_args={"retries": 3, "retry_delay": timedelta(minutes=5)}) as dag:
    PythonOperator(task_id="generate", python_callable=submit_and_wait, execution_timeout=timedelta(hours=25))
