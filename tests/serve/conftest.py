"""A service on 127.0.0.1 with an ephemeral port: uvicorn in a thread (fast tests, null engine), or
`qbatch serve` in a subprocess (real engine, kill -9). Every service a test starts, it stops."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check, timeout_s: float = WAIT_S, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"not done within {timeout_s}s")


def requests_jsonl(n: int, *, url: str = "/v1/chat/completions", prefix: str = "req", max_tokens: int = 4) -> bytes:
    lines = []
    for i in range(n):
        body = ({"messages": [{"role": "user", "content": f"say {i}"}]} if url == "/v1/chat/completions"
                else {"prompt": f"count {i}"})
        body["max_completion_tokens" if url == "/v1/chat/completions" else "max_tokens"] = max_tokens
        lines.append(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": url, "body": body}))
    return ("\n".join(lines) + "\n").encode()


def client_for(base_url: str, api_key: str = "unused"):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)


def run_to_end(client, data: bytes, *, endpoint: str = "/v1/chat/completions", timeout_s: float = WAIT_S):
    file = client.files.create(file=("batch.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h")
    return wait_until(lambda: _done(client, batch.id), timeout_s)


def _done(client, batch_id: str):
    batch = client.batches.retrieve(batch_id)
    return batch if batch.status in ("completed", "failed", "cancelled", "expired") else None


def lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def slow_null_engine():
    """A null engine finishing a row every 20 ms, reporting in between as engines do: a run long enough
    to stop in the middle."""
    from qbatch.engines.base import NullEngine

    class Slow(NullEngine):
        def run(self, chunks):
            for chunk in chunks:
                for request in chunk.requests if chunk is not None else []:
                    time.sleep(0.02)
                    yield None
                    yield chunk, [self._complete(request)]

    return Slow()


@pytest.fixture
def make_service(tmp_path, bundled_model):
    """make_service(**settings) -> (base_url, service) of a service on a uvicorn thread, null engine by
    default; `pool=` runs it on that pool's (stand-in) engines."""
    from qbatch.log import setup as setup_log
    from qbatch.serve.config import ServeSettings
    from qbatch.serve.server import serve_in_thread

    setup_log()  # qbatch's log as `qbatch serve` has it (its command group sets it up): INFO and up
    started = []

    def make(engine: dict | None = None, pool=None, **settings):
        engine = engine or {"model": bundled_model, "backend": "null"}
        port = free_port()
        service, server, thread = serve_in_thread(ServeSettings(tmp_path / f"data-{len(started)}", engine,
                                                                 {"progress": "none"}, port=port, **settings),
                                                  pool=pool)
        started.append((service, server, thread))
        wait_until(lambda: server.started, 30)
        wait_until(lambda: service.worker.ready.is_set() or service.worker.failed, WAIT_S)
        return f"http://127.0.0.1:{port}/v1", service

    yield make
    for service, server, thread in started:
        server.should_exit = True
        service.worker.stop()
        thread.join(10)
        service.worker.join(30)
        service.close()


@pytest.fixture
def serve_process(tmp_path):
    """serve_process(*flags, data_dir=...) -> (base_url, Popen) for `qbatch serve` in a subprocess."""
    procs = []

    def start(*flags: str, data_dir: Path, port: int | None = None, env: dict | None = None):
        port = port or free_port()
        log = open(tmp_path / f"serve-{len(procs)}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "qbatch.cli", "serve", "--data-dir", str(data_dir),
                                 "--port", str(port), *flags], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
        procs.append((proc, log))
        return f"http://127.0.0.1:{port}", proc

    yield start
    for proc, log in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()
