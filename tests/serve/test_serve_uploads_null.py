"""Uploads to `qbatch serve` within their limits while they stream (null engine): a chunked body without a
Content-Length is refused the moment it passes --max-upload-bytes, its bytes never leave the data folder,
and uploads received at once are bounded."""

from __future__ import annotations

import select
import socket

import httpx
import pytest

from tests.serve.conftest import client_for, requests_jsonl, wait_until

BOUNDARY = "qbatch-test-boundary"


class ChunkedUpload:
    """A raw HTTP/1.1 upload to POST /v1/files with Transfer-Encoding: chunked, sent as slowly as a test likes."""

    def __init__(self, base_url: str):
        url = httpx.URL(base_url)
        self.sock = socket.create_connection((url.host, url.port), timeout=10)
        self.sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: {url.host}\r\nTransfer-Encoding: chunked\r\n"
                          f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n".encode())
        self.sent = 0
        self.chunk(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{BOUNDARY}\r\n'
                   'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'.encode())

    def chunk(self, data: bytes) -> None:
        self.sock.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.sent += len(data)

    def answered(self) -> bool:
        return bool(select.select([self.sock], [], [], 0)[0])

    def status(self) -> int:
        return int(self.sock.recv(65536).split(b" ", 2)[1])

    def close(self) -> None:
        self.sock.close()


def test_a_streamed_upload_stops_at_the_limit_with_a_413(make_service):
    base_url, service = make_service(max_upload_bytes=100_000)
    upload = ChunkedUpload(base_url)
    block = requests_jsonl(400)  # ~50 kB of good lines
    try:
        while not upload.answered() and upload.sent < 200 * 1024 * 1024:
            try:
                upload.chunk(block)
            except OSError:  # the service closed the connection (or stopped reading: the send timed out)
                break
        assert upload.sent < 20 * 1024 * 1024  # what the sockets' buffers hold past the limit, not the body
        assert upload.status() == 413
    finally:
        upload.close()
    files = service.settings.data_dir / "files"
    assert wait_until(lambda: not any(files.iterdir()), 10)  # its temporary file is gone
    assert client_for(base_url).files.list().data == []


def test_uploads_received_at_once_are_bounded(make_service, monkeypatch):
    from qbatch.serve import upload as upload_module

    monkeypatch.setattr(upload_module, "WAIT_S", 0.5)
    base_url, service = make_service()
    stalled = [ChunkedUpload(base_url) for _ in range(upload_module.MAX_UPLOADS)]
    files = service.settings.data_dir / "files"
    try:
        wait_until(lambda: files.is_dir() and len(list(files.iterdir())) == upload_module.MAX_UPLOADS, 10)
        refused = httpx.post(base_url + "/files", files={"file": ("x.jsonl", requests_jsonl(1))},
                             data={"purpose": "batch"}, timeout=30)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        for upload in stalled:
            upload.close()
    client = client_for(base_url)
    file = wait_until(lambda: _upload(client), 30)  # the stalled clients went away: their slots are free
    assert [path.name for path in files.iterdir()] == [f"{file.id}.jsonl"]  # nothing of theirs is left


def _upload(client):
    import openai

    try:
        return client.files.create(file=("in.jsonl", requests_jsonl(2)), purpose="batch")
    except openai.RateLimitError:
        return None


@pytest.mark.parametrize(("content", "headers", "message"), [
    (b"--x\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n\r\n{}", None,
     "the body ended inside a part of the form"),
    (b"garbage", None, "the body is not a valid multipart form"),
    (b'--x\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--x--\r\n', None,
     "no file in the form's 'file' field"),
    (b"{}", {"content-type": "application/json"}, "expected a multipart/form-data body, got 'application/json'"),
])
def test_a_malformed_form_is_a_400(make_service, content, headers, message):
    base_url, service = make_service()
    response = httpx.post(base_url + "/files", content=content, timeout=30,
                          headers=headers or {"content-type": "multipart/form-data; boundary=x"})
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    assert not any((service.settings.data_dir / "files").iterdir())


def test_uploads_a_stopped_service_was_receiving_are_removed_when_it_starts(make_service, tmp_path):
    files = tmp_path / "data-0" / "files"  # make_service's first data folder
    files.parent.mkdir(mode=0o700)  # as a service leaves it
    files.mkdir()
    (files / f"file-{'0' * 24}.jsonl.tmp-999999999").write_bytes(b'{"custom_id": "half')  # no such process
    make_service()
    assert not any(files.iterdir())
