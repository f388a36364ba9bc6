"""`Session.run(..., output_dir="s3://...")` works as `qbatch run -o s3://...`: the folder's lock taken, the
run on a local copy uploaded when the call ends, a rerun resuming from the bucket; null engine, moto's server."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import polars as pl
import pytest

from qbatch.errors import LockedError, SpecError
from qbatch.session.session import Session


def test_a_session_runs_into_an_s3_folder_and_resumes_from_it(bundled_model, s3, bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the stage folders, to see that none stays
    url = f"s3://{bucket}/out"
    rows = [{"id": f"r{i}", "prompt": f"hi {i}"} for i in range(12)]
    with Session(bundled_model, backend="null") as session:
        result = session.run(rows, output_dir=url, max_tokens=4, progress="none")
        assert sorted(result.results["id"].to_list()) == sorted(r["id"] for r in rows)
        assert result.output_dir == url and result.summary.output_dir == url
        assert f"output {url}" in repr(result)
        manifest = json.loads(s3.get_object(Bucket=bucket, Key="out/manifest.json")["Body"].read())
        assert manifest["status"] == "completed"
        uploaded = pl.read_parquet(io.BytesIO(s3.get_object(Bucket=bucket, Key="out/results.parquet")["Body"].read()))
        assert sorted(uploaded["id"].to_list()) == sorted(r["id"] for r in rows)
        assert json.loads(s3.get_object(Bucket=bucket, Key="out/.qbatch.lock")["Body"].read())["released"] is True

        again = session.run(rows, output_dir=url, max_tokens=4, progress="none")  # the input file is in the bucket
        assert again.summary.rows_skipped == len(rows) and again.results.height == len(rows)

        from qbatch.storage.lock import RemoteLock
        from qbatch.storage.store import Store
        from qbatch.storage.urls import Url

        other = RemoteLock(Store(Url.parse(url)), Url.parse(url))  # a run on another machine holds it
        other.acquire()
        try:
            with pytest.raises(LockedError, match="another qbatch run is using this output folder"):
                session.run(rows, output_dir=url, max_tokens=4, progress="none")
        finally:
            other.release()
        with pytest.raises(SpecError, match="lost the second slash") as refused:
            session.run(rows, output_dir=Path(url), max_tokens=4, progress="none")
        assert 'output_dir="s3://bucket/out"' in refused.value.hint
    assert not list(tmp_path.glob("qbatch-stage-*"))


def test_the_engine_log_of_a_run_into_a_bucket_is_no_local_folder_named_after_the_url(bundled_model):
    from qbatch.spec import JobSpec

    spec = JobSpec.from_flat({"model": bundled_model, "inputs": ["in.jsonl"], "output_dir": "s3://bucket/out"})
    session = Session.for_spec(spec)
    try:
        assert not str(session.engine_log).startswith(("s3:", str(Path.cwd() / "s3:")))
    finally:
        session.close()
