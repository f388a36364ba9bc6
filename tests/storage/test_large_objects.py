"""A large object is streamed to disk a block at a time: the process's memory stays bounded whatever the
object's size (docs/guides/object-storage.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

OBJECT_MB = 96
MAX_GROWTH_MB = 64  # the copy's blocks (8 MiB) and the client's buffers (up to 49 on a loaded CI machine); a whole download would be 96+

PROBE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from qbatch.storage.store import Store
    from qbatch.storage.urls import Url

    def peak_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024

    url = Url.parse(sys.argv[1])
    store = Store(url)
    store.info(url)  # the client's own start, before the baseline
    before = peak_mb()
    store.download(url, Path(sys.argv[2]))
    print(peak_mb() - before)
""")


def test_a_large_object_is_downloaded_in_bounded_memory(s3, bucket, tmp_path):
    block = os.urandom(1 << 20)
    upload = s3.create_multipart_upload(Bucket=bucket, Key="big.jsonl")
    parts = []
    for number in range(1, OBJECT_MB // 16 + 1):  # 16 MiB parts: the object never whole in this process either
        reply = s3.upload_part(Bucket=bucket, Key="big.jsonl", UploadId=upload["UploadId"], PartNumber=number,
                               Body=block * 16)
        parts.append({"PartNumber": number, "ETag": reply["ETag"]})
    s3.complete_multipart_upload(Bucket=bucket, Key="big.jsonl", UploadId=upload["UploadId"],
                                 MultipartUpload={"Parts": parts})
    copy = tmp_path / "big.jsonl"
    probe = subprocess.run([sys.executable, "-c", PROBE, f"s3://{bucket}/big.jsonl", str(copy)], capture_output=True,
                           text=True, timeout=300, env={**os.environ})
    assert probe.returncode == 0, probe.stderr
    assert copy.stat().st_size == OBJECT_MB << 20
    assert int(probe.stdout) < MAX_GROWTH_MB, f"memory grew {probe.stdout.strip()} MB for a {OBJECT_MB} MB object"
