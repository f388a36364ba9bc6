"""Thin copies (storage/thin.py): a resume and `qbatch status` of an s3:// folder copy the parts' ids, not their
rows; the resume makes them whole to assemble; a thin copy never goes up. Null engine, moto's server; every
object counts as large enough to copy thin (THIN_MIN_BYTES 0)."""

from __future__ import annotations

import io
import json

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qbatch.storage import thin
from qbatch.storage.stage import StagedFolder
from qbatch.storage.store import Store
from qbatch.storage.urls import Url


@pytest.fixture
def downloads(monkeypatch):
    """The keys downloaded whole, in order (thin copies read ranges instead)."""
    monkeypatch.setattr(thin, "THIN_MIN_BYTES", 0)
    keys: list[str] = []
    download = Store.download
    monkeypatch.setattr(Store, "download", lambda self, url, path: (keys.append(url.key), download(self, url, path))[1])
    return keys


def _put_rows(s3, bucket, count):
    body = "".join(json.dumps({"id": f"r{i:04d}", "prompt": f"hi {i}", "doc": "text " * 40}) + "\n" for i in range(count))
    s3.put_object(Bucket=bucket, Key="in.jsonl", Body=body.encode())


def _etags(s3, bucket, prefix):
    return {o["Key"]: o["ETag"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])}


def test_status_and_resume_read_the_parts_ids_and_assemble_from_whole_parts(run_null, cli, s3, bucket, downloads,
                                                                           monkeypatch):
    from qbatch.jobs import parts

    monkeypatch.setattr(parts, "PART_MIN_S", 0.0)  # a part at each chunk's end
    url = f"s3://{bucket}/out"
    args = ("-o", url, "--max-tokens", "4", "--chunk-tokens", "600")
    _put_rows(s3, bucket, 40)
    assert run_null(f"s3://{bucket}/in.jsonl", *args).exit_code == 0
    written = _etags(s3, bucket, "out/parts/")
    assert len(written) >= 3

    downloads.clear()
    status = cli("status", url, "--json")
    assert status.exit_code == 0, status.output
    assert json.loads(status.stdout)["rows_done"] == 40
    assert not [k for k in downloads if "/parts/" in k or k.endswith(("results.parquet", "errors.parquet"))]  # their ids

    _put_rows(s3, bucket, 50)  # rows appended to the input: a resume
    downloads.clear()
    again = run_null(f"s3://{bucket}/in.jsonl", *args)
    assert again.exit_code == 0, again.output
    assert "rows already done               40" in again.stdout
    assert sorted(k for k in downloads if "/parts/" in k or k.endswith("results.parquet")) == sorted(written)  # to assemble
    now = _etags(s3, bucket, "out/parts/")
    assert {k: now[k] for k in written} == written  # the earlier parts as they were: none went up again
    results = pl.read_parquet(io.BytesIO(s3.get_object(Bucket=bucket, Key="out/results.parquet")["Body"].read()))
    assert results["id"].to_list() == [f"r{i:04d}" for i in range(50)] and "doc" in results.columns


def test_a_thin_copy_never_goes_up_and_fill_makes_it_whole(s3, bucket, downloads):
    from qbatch.output.folder import IDS_ONLY

    table = pa.table({"id": ["a", "b"], "text": ["one", "two"], "error": [None, None]})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    s3.put_object(Bucket=bucket, Key="out/parts/part-000001.parquet", Body=buffer.getvalue())
    s3.put_object(Bucket=bucket, Key="out/manifest.json", Body=b"{}")
    before = _etags(s3, bucket, "out/parts/")
    folder = StagedFolder(Url.parse(f"s3://{bucket}/out"), locked=True, thin=IDS_ONLY).open()
    try:
        part = folder.path / "parts" / "part-000001.parquet"
        assert pq.read_table(part).column_names == ["id", "error"] and thin.is_thin(part)
        rewritten = pq.read_table(part)  # a rewrite that did not make it whole first (its metadata kept)
        pq.write_table(rewritten.append_column("more", pa.array([1, 2])), part)
        folder.push()
        assert _etags(s3, bucket, "out/parts/") == before  # the object keeps its rows

        folder.fill(folder.path / "parts")
        assert pq.read_table(part).equals(table) and not thin.is_thin(part)
        folder.close()
    except BaseException:
        folder.discard()
        raise
    assert pq.read_table(io.BytesIO(s3.get_object(Bucket=bucket, Key="out/parts/part-000001.parquet")["Body"].read())).equals(table)


def test_a_resume_that_widens_a_column_rewrites_whole_parts(run_null_short, s3, bucket, downloads):
    # opening.py rewrites the earlier parts in the widened type: they are made whole first, else the rewrite
    # of a thin copy (its ids only) would not hold the column to widen
    rows = [{"id": "a", "prompt": "one", "score": 1}, {"id": "b", "prompt": "two", "score": 2}]
    body = "".join(json.dumps(r) + "\n" for r in rows)
    s3.put_object(Bucket=bucket, Key="in.jsonl", Body=body.encode())
    assert run_null_short(f"s3://{bucket}/in.jsonl", "-o", f"s3://{bucket}/out").exit_code == 0
    s3.put_object(Bucket=bucket, Key="in.jsonl", Body=(body + json.dumps({"id": "n", "prompt": "new", "score": 2.5}) + "\n").encode())
    result = run_null_short(f"s3://{bucket}/in.jsonl", "-o", f"s3://{bucket}/out")
    assert result.exit_code == 0, result.output
    first = pl.read_parquet(io.BytesIO(s3.get_object(Bucket=bucket, Key="out/parts/part-000001.parquet")["Body"].read()))
    assert first.schema["score"] == pl.Float64 and first["id"].to_list() == ["a", "b"]
    results = pl.read_parquet(io.BytesIO(s3.get_object(Bucket=bucket, Key="out/results.parquet")["Body"].read()))
    assert results["score"].to_list() == [1.0, 2.0, 2.5]
