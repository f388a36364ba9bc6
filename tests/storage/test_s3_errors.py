"""An object store that refuses: bad credentials, none at all, no such bucket. A one-line error with a hint,
exit 2, no traceback, and never the secret."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from qbatch.errors import EXIT_USAGE

from tests.storage.conftest import SECRET


@pytest.fixture(scope="module")
def strict_server():
    """A second moto server that checks credentials (none are known to it: every key is refused)."""
    pytest.importorskip("moto.server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as client:
            if client.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    yield f"http://127.0.0.1:{port}"
    server.terminate()
    server.wait()


def _refused(result, *words):
    assert result.exit_code == EXIT_USAGE, result.output
    assert "Traceback" not in result.output and SECRET not in result.output
    error = next(line for line in result.output.splitlines() if line.startswith("Error:"))
    for word in words:
        assert word in result.output
    return error


def test_bad_credentials_are_a_clear_error_without_the_secret(run_null_short, strict_server, monkeypatch, s3_server):
    monkeypatch.setenv("AWS_ENDPOINT_URL", strict_server)
    result = run_null_short("s3://some-bucket/in.jsonl", "-o", "s3://some-bucket/out")
    error = _refused(result, "Hint: the store refused the credentials or found none")
    assert error == ("Error: cannot write s3://some-bucket/out/.qbatch.lock: "
                     "The AWS Access Key Id you provided does not exist in our records.")


def test_no_credentials_at_all(run_null_short, monkeypatch, s3_server, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    result = run_null_short("s3://some-bucket/in.jsonl", "-o", str(tmp_path / "out"))
    _refused(result, "s3://some-bucket/in.jsonl", "Hint: the store refused the credentials or found none")


def test_no_such_bucket(run_null_short, s3_server, tmp_path):
    result = run_null_short("s3://no-such-bucket-here/in.jsonl", "-o", "s3://no-such-bucket-here/out")
    error = _refused(result, "Hint: check the bucket's name 'no-such-bucket-here'")
    assert error == "Error: cannot write s3://no-such-bucket-here/out/.qbatch.lock: no such bucket"
