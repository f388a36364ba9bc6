"""Which library reads and writes S3 objects for qbatch (docs/benchmarks.md, #object-stores).

Starts moto's S3 server in its own process, puts one 256 MiB object, then in a fresh process per library
streams it (counting bytes, 1 MiB reads) and makes 50 small PUTs; prints one JSON line per library with
its peak RSS (VmHWM: the process's own, not its parent's).

    .venv/bin/python benchmarks/object_stores.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

OBJECT_MIB = 256


def child(lib: str) -> None:
    url = os.environ["AWS_ENDPOINT_URL"]
    t0, n = time.perf_counter(), 0
    if lib.startswith("s3fs"):
        import s3fs
        fs = s3fs.S3FileSystem()
        import_s, t0 = time.perf_counter() - t0, time.perf_counter()
        if lib == "s3fs-get_file":
            fs.get_file("bench/big.bin", "/tmp/qbatch-bench-big.bin")
            n = os.path.getsize("/tmp/qbatch-bench-big.bin")
            os.unlink("/tmp/qbatch-bench-big.bin")
        else:
            with fs.open("bench/big.bin", "rb", block_size=8 << 20) as f:
                while b := f.read(1 << 20):
                    n += len(b)
        read_s, t0 = time.perf_counter() - t0, time.perf_counter()
        for i in range(50):
            fs.pipe_file(f"bench/small/{i}", b"x" * 1000)
    elif lib == "pyarrow":
        from pyarrow import fs as pafs
        fs = pafs.S3FileSystem(endpoint_override=url, scheme="http", region="us-east-1")
        import_s, t0 = time.perf_counter() - t0, time.perf_counter()
        with fs.open_input_stream("bench/big.bin") as f:
            while b := f.read(1 << 20):
                n += len(b)
        read_s, t0 = time.perf_counter() - t0, time.perf_counter()
        for i in range(50):
            with fs.open_output_stream(f"bench/small/{i}") as out:
                out.write(b"x" * 1000)
    else:
        import obstore
        from obstore.store import S3Store
        store = S3Store("bench", endpoint=url, allow_http=True, region="us-east-1")
        import_s, t0 = time.perf_counter() - t0, time.perf_counter()
        for chunk in obstore.get(store, "big.bin").stream(min_chunk_size=1 << 20):
            n += len(chunk)
        read_s, t0 = time.perf_counter() - t0, time.perf_counter()
        for i in range(50):
            obstore.put(store, f"small/{i}", b"x" * 1000)
    put_ms = (time.perf_counter() - t0) / 50 * 1000
    peak = next(int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    assert n == OBJECT_MIB << 20
    print(json.dumps({"lib": lib, "import_s": round(import_s, 2), "stream_s": round(read_s, 2),
                      "MB_s": round(n / 2**20 / read_s), "small_put_ms": round(put_ms, 1), "peak_rss_MB": peak}))


def main() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = dict(os.environ, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1",
               AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    try:
        time.sleep(4)
        import boto3
        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")
        s3.create_bucket(Bucket="bench")
        s3.put_object(Bucket="bench", Key="big.bin", Body=os.urandom(OBJECT_MIB << 20))
        for lib in ("obstore", "s3fs", "s3fs-get_file", "pyarrow"):
            out = subprocess.run([sys.executable, __file__, lib], env=env, capture_output=True, text=True)
            print(out.stdout.strip() or out.stderr[-800:])
    finally:
        server.terminate()


if __name__ == "__main__":
    child(sys.argv[1]) if len(sys.argv) > 1 else main()
