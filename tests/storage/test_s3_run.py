"""`qbatch run` with s3:// inputs and an s3:// output folder, against moto's S3 server (conftest.py)."""

from __future__ import annotations

import io
import json

import polars as pl


def _put_jsonl(s3, bucket, key, rows):
    s3.put_object(Bucket=bucket, Key=key, Body="".join(json.dumps(r) + "\n" for r in rows).encode())


def _parquet(s3, bucket, key):
    return pl.read_parquet(io.BytesIO(s3.get_object(Bucket=bucket, Key=key)["Body"].read()))


def _keys(s3, bucket, prefix=""):
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def test_run_from_a_glob_into_an_s3_folder(run_null_short, s3, bucket):
    for part in range(3):
        _put_jsonl(s3, bucket, f"prompts/p{part}.jsonl", [{"id": f"{part}-{i}", "prompt": f"hi {i}"} for i in range(4)])
    _put_jsonl(s3, bucket, "prompts/other.txt.jsonl.bak", [{"id": "x", "prompt": "no"}])
    result = run_null_short(f"s3://{bucket}/prompts/p*.jsonl", "-o", f"s3://{bucket}/out")
    assert result.exit_code == 0, result.output
    keys = _keys(s3, bucket, "out/")
    assert {"out/manifest.json", "out/results.parquet", "out/stats.json"} <= set(keys)
    assert not any(k.startswith("out/inputs/") for k in keys)  # the objects are in the store already
    df = _parquet(s3, bucket, "out/results.parquet")
    assert sorted(df["id"].to_list()) == sorted(f"{p}-{i}" for p in range(3) for i in range(4))
    assert set(df["source"].to_list()) == {f"s3://{bucket}/prompts/p{p}.jsonl" for p in range(3)}
    manifest = json.loads(s3.get_object(Bucket=bucket, Key="out/manifest.json")["Body"].read())
    assert manifest["status"] == "completed"
    assert [i["path"] for i in manifest["fingerprint"]["inputs"]] == [f"s3://{bucket}/prompts/p{p}.jsonl" for p in range(3)]
    assert f"s3://{bucket}/out/results.parquet" in result.stdout
    lock = json.loads(s3.get_object(Bucket=bucket, Key="out/.qbatch.lock")["Body"].read())
    assert lock["released"] is True

    again = run_null_short(f"s3://{bucket}/prompts/p*.jsonl", "-o", f"s3://{bucket}/out")
    assert again.exit_code == 0, again.output
    assert "rows already done               12" in again.stdout
