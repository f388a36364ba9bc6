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
    dry = run_null_short(f"s3://{bucket}/prompts/", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "rows already done               12" in again.stdout


def test_status_report_and_merge_on_s3_folders(run_null_short, cli, s3, bucket):
    rows = [{"id": f"r{i}", "prompt": f"hi {i}"} for i in range(20)]
    _put_jsonl(s3, bucket, "in/rows.jsonl", rows)
    for shard in range(2):
        result = run_null_short(f"s3://{bucket}/in/", "-o", f"s3://{bucket}/out/shard-{shard}", "--shard", f"{shard}/2",
                                "--report")
        assert result.exit_code == 0, result.output

    status = cli("status", f"s3://{bucket}/out/shard-0", "--json")
    assert status.exit_code == 0, status.output
    info = json.loads(status.stdout)
    assert info["output_dir"] == f"s3://{bucket}/out/shard-0" and info["status"] == "completed"
    assert info["running"] is None and 0 < info["rows_done"] < 20

    report = cli("report", f"s3://{bucket}/out/shard-1")
    assert report.exit_code == 0, report.output
    assert report.stdout.strip() == f"s3://{bucket}/out/shard-1/report.html"
    page = s3.get_object(Bucket=bucket, Key="out/shard-1/report.html")["Body"].read()
    assert page.startswith(b"<!DOCTYPE html>") or b"<html" in page[:500]

    merged = cli("merge", f"s3://{bucket}/out/shard-0", f"s3://{bucket}/out/shard-1", "-o", f"s3://{bucket}/out/all")
    assert merged.exit_code == 0, merged.output
    assert f"into s3://{bucket}/out/all: 20 results" in merged.stdout
    df = _parquet(s3, bucket, "out/all/results.parquet")
    assert sorted(df["id"].to_list()) == sorted(r["id"] for r in rows)
    manifest = json.loads(s3.get_object(Bucket=bucket, Key="out/all/manifest.json")["Body"].read())
    assert manifest["merged_from"] == [f"s3://{bucket}/out/shard-0", f"s3://{bucket}/out/shard-1"]

    missing = cli("status", f"s3://{bucket}/nothing-here")
    assert missing.exit_code != 0
    assert f"not a qbatch output folder (no manifest.json) (s3://{bucket}/nothing-here)" in missing.output


def test_embed_from_a_parquet_object_into_an_s3_folder(cli, bundled_model, s3, bucket):
    frame = pl.DataFrame({"id": [f"e{i}" for i in range(10)], "prompt": [f"text {i}" for i in range(10)]})
    buffer = io.BytesIO()
    frame.write_parquet(buffer)
    s3.put_object(Bucket=bucket, Key="docs/texts.parquet", Body=buffer.getvalue())
    result = cli("embed", f"s3://{bucket}/docs/texts.parquet", "-o", f"s3://{bucket}/vectors", "--model", bundled_model,
                 "--backend", "null", "--progress", "none")
    assert result.exit_code == 0, result.output
    df = _parquet(s3, bucket, "vectors/results.parquet")
    assert df["id"].to_list() == frame["id"].to_list() and "embedding" in df.columns


def test_changed_input_object_is_refused_on_resume(run_null_short, s3, bucket):
    from qbatch.errors import EXIT_MISMATCH

    _put_jsonl(s3, bucket, "in.jsonl", [{"id": f"r{i}", "prompt": f"hi {i}"} for i in range(5)])
    assert run_null_short(f"s3://{bucket}/in.jsonl", "-o", f"s3://{bucket}/out").exit_code == 0
    _put_jsonl(s3, bucket, "in.jsonl", [{"id": f"r{i}", "prompt": f"ho {i}"} for i in range(5)])  # same size
    again = run_null_short(f"s3://{bucket}/in.jsonl", "-o", f"s3://{bucket}/out")
    assert again.exit_code == EXIT_MISMATCH, again.output
    assert f"input s3://{bucket}/in.jsonl changed (not only appended to): same size" in again.output


def test_standard_input_into_an_s3_folder_resumes(engine_pool, bundled_model, s3, bucket):
    # the spooled copy lies in the run's local copy of the folder: recorded by its URL in the bucket, which a
    # resume's copy (another folder, another machine) has too
    from click.testing import CliRunner

    from qbatch.cli import EngineHandoff
    from qbatch.cli import cli as qbatch_cli

    rows = "".join(json.dumps({"id": f"r{i}", "prompt": f"hi {i}"}) + "\n" for i in range(6))
    args = ["run", "-", "-o", f"s3://{bucket}/out", "--model", bundled_model, "--backend", "null", "--progress", "none",
            "--max-tokens", "4"]
    for _ in range(2):
        result = CliRunner().invoke(qbatch_cli, args, input=rows, catch_exceptions=False, obj=EngineHandoff(engine_pool))
        assert result.exit_code == 0, result.output
    assert "rows already done               6" in result.stdout
    manifest = json.loads(s3.get_object(Bucket=bucket, Key="out/manifest.json")["Body"].read())
    assert [i["path"] for i in manifest["fingerprint"]["inputs"]][0].startswith(f"s3://{bucket}/out/inputs/")
