"""Bytes a resume and `qbatch status` download from an s3:// output folder, whole copies against thin ones
(storage/thin.py; docs/benchmarks.md, #resume-bytes).

moto's S3 server in this process; the null engine. A first run writes ROWS rows that carry a DOC_BYTES text
column of random letters (as long generated texts would: parts that do not compress away) into an s3://
folder, in several parts; then NEW_ROWS more rows are appended to the input object, and a second run
resumes the folder. Each is done twice, once with every object copied whole (THIN_MIN_BYTES above any
part: the code before thin copies) and once as qbatch does now; prints one JSON line per way with the
bytes the stage read before the run could start (the pull), in all, and `qbatch status`' bytes.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/resume_bytes.py
"""

from __future__ import annotations

import json
import os
import random
import string
import sys

ROWS, NEW_ROWS, DOC_BYTES = 12_000, 1_000, 1_500


def _rows(start: int, count: int) -> bytes:
    rng = random.Random(start)
    return "".join(json.dumps({"id": f"r{i:06d}", "prompt": f"summarize document {i}",
                               "doc": "".join(rng.choices(string.ascii_letters + " ", k=DOC_BYTES))}) + "\n"
                   for i in range(start, start + count)).encode()


def main() -> None:
    import boto3
    from click.testing import CliRunner
    from moto.server import ThreadedMotoServer

    from qbatch.cli import cli
    from qbatch.jobs import parts
    from qbatch.models import registry
    from qbatch.storage import stage, thin

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_REGION="us-east-1")
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="bench")
    s3.put_object(Bucket="bench", Key="in/a.jsonl", Body=_rows(0, ROWS))
    parts.PART_MIN_S = 0.0  # a part at each chunk's end: several parts
    model = registry.resolve("smollm2-135m")
    common = ["--model", model, "--backend", "null", "--max-tokens", "4", "--progress", "none", "--chunk-tokens", "80000"]
    read: dict[str, int] = {}
    pull, close = stage.StagedFolder.pull, stage.StagedFolder.close

    def counted_pull(self: stage.StagedFolder) -> None:
        pull(self)
        read["pull"] = self.store.bytes_read

    def counted_close(self: stage.StagedFolder) -> None:
        read["total"] = self.store.bytes_read  # before close's uploads (which read nothing)
        close(self)

    stage.StagedFolder.pull, stage.StagedFolder.close = counted_pull, counted_close  # type: ignore[method-assign]
    runner = CliRunner()
    folders = {"whole": "s3://bench/out-whole", "thin": "s3://bench/out-thin"}
    for folder in folders.values():
        first = runner.invoke(cli, ["run", "s3://bench/in/a.jsonl", "-o", folder, *common], catch_exceptions=False)
        assert first.exit_code == 0, first.output
    s3.put_object(Bucket="bench", Key="in/a.jsonl", Body=_rows(0, ROWS) + _rows(ROWS, NEW_ROWS))  # rows appended
    default_min = thin.THIN_MIN_BYTES
    for way, folder in folders.items():
        thin.THIN_MIN_BYTES = 1 << 40 if way == "whole" else default_min
        key = folder.removeprefix("s3://bench/")
        objects = s3.list_objects_v2(Bucket="bench", Prefix=key + "/")["Contents"]
        part_sizes = [o["Size"] for o in objects if "/parts/part-" in o["Key"]]
        folder_bytes = sum(o["Size"] for o in objects)
        read.clear()
        status = runner.invoke(cli, ["status", folder, "--json"], catch_exceptions=False)
        assert status.exit_code == 0, status.output
        status_bytes = read["pull"]
        read.clear()
        second = runner.invoke(cli, ["run", "s3://bench/in/a.jsonl", "-o", folder, *common], catch_exceptions=False)
        assert second.exit_code == 0, second.output
        done = json.loads(s3.get_object(Bucket="bench", Key=f"{key}/manifest.json")["Body"].read())
        assert done["status"] == "completed" and done["counts"]["rows_ok"] == ROWS + NEW_ROWS, done["counts"]
        print(json.dumps({"way": way, "folder_bytes": folder_bytes, "parts": len(part_sizes),
                          "part_bytes": sum(part_sizes), "status_bytes": status_bytes,
                          "resume_pull_bytes": read["pull"], "resume_total_bytes": read["total"]}))
        sys.stdout.flush()
    server.stop()


if __name__ == "__main__":
    main()
