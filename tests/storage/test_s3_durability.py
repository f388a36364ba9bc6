"""An s3:// output folder keeps a local folder's guarantees: a run SIGKILLed on one machine is resumed by
another process once its lease lapsed (every row once), a second run finds the folder held, a half-uploaded
part is no part. The runs are real CLI processes on the null engine; the store is moto's S3 server."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

from qbatch.errors import EXIT_LOCKED

ROOT = Path(__file__).resolve().parents[2]


def _keys(s3, bucket, prefix):
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _part_ids(s3, bucket, prefix="out/parts/part-"):
    ids: list[str] = []
    for key in _keys(s3, bucket, prefix):
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        ids += pq.read_table(io.BytesIO(body), columns=["id"]).column("id").to_pylist()  # every part whole
    return ids


def test_a_run_killed_in_one_process_is_resumed_by_another_after_its_lease(s3, bucket, bundled_model):
    rows = [{"id": f"r{i:05d}", "prompt": "word " * (i % 20 + 1)} for i in range(20_000)]
    s3.put_object(Bucket=bucket, Key="in/rows.jsonl", Body="".join(json.dumps(r) + "\n" for r in rows).encode())
    cmd = [sys.executable, "-m", "qbatch.cli", "run", f"s3://{bucket}/in/rows.jsonl", "-o", f"s3://{bucket}/out",
           "--model", bundled_model, "--backend", "null", "--chunk-tokens", "3000", "--max-tokens", "4",
           "--progress", "none"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "QBATCH_LOCK_LEASE_S": "3"}  # a sync every 0.75 s
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and first.poll() is None and not _keys(s3, bucket, "out/parts/part-"):
        time.sleep(0.1)
    # killed mid-run, not after it: at its first part (parts come at most every parts.PART_MIN_S)
    assert first.poll() is None, first.stderr.read()
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    done = _part_ids(s3, bucket)
    assert 0 < len(done) < len(rows) and len(done) == len(set(done))
    assert json.loads(s3.get_object(Bucket=bucket, Key="out/manifest.json")["Body"].read())["status"] == "running"

    time.sleep(4)  # its lease (3 s) lapses, as another machine would find it
    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert "stopped renewing its lease" in second.stderr  # it waited for the lease, then took the folder over
    ids = _part_ids(s3, bucket)
    assert sorted(ids) == [r["id"] for r in rows]  # every row once: nothing lost, nothing doubled
    assert f"rows already done               {len(done):,}" in second.stdout
    results = pl.read_parquet(io.BytesIO(s3.get_object(Bucket=bucket, Key="out/results.parquet")["Body"].read()))
    assert results["id"].to_list() == [r["id"] for r in rows]


def test_a_second_run_finds_the_folder_held_and_a_half_uploaded_part_is_no_part(run_null_short, s3, bucket):
    rows = "".join(json.dumps({"id": f"r{i}", "prompt": f"hi {i}"}) + "\n" for i in range(30))
    s3.put_object(Bucket=bucket, Key="in.jsonl", Body=rows.encode())
    # a part whose multipart upload never completed (its run died mid-upload): the store shows no object
    upload = s3.create_multipart_upload(Bucket=bucket, Key="out/parts/part-000001.parquet")
    s3.upload_part(Bucket=bucket, Key="out/parts/part-000001.parquet", UploadId=upload["UploadId"], PartNumber=1,
                   Body=b"PAR1" + b"\0" * 1000)
    # a run on another machine holds the folder (its lease runs for a minute)
    from qbatch.storage.lock import RemoteLock
    from qbatch.storage.store import Store
    from qbatch.storage.urls import Url

    folder = Url.parse(f"s3://{bucket}/out")
    other = RemoteLock(Store(folder), folder)
    other.acquire()
    held = run_null_short(f"s3://{bucket}/in.jsonl", "-o", f"s3://{bucket}/out")
    assert held.exit_code == EXIT_LOCKED, held.output
    assert "Error: another qbatch run is using this output folder (pid" in held.output
    other.release()

    result = run_null_short(f"s3://{bucket}/in.jsonl", "-o", f"s3://{bucket}/out")
    assert result.exit_code == 0, result.output
    assert sorted(_part_ids(s3, bucket)) == sorted(f"r{i}" for i in range(30))
