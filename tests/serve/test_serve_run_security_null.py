"""Who may hand a job to `qbatch serve` without an API key: the service's own Unix user only, proven by the
owner of the client's socket, never by a header; a client whose owner cannot be found is refused (fail
closed). What the service writes for a job or a batch is private to its user."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import stat
import subprocess
import sys
import uuid

import pytest

from qbatch.serve.wire import RUN_ROUTE

OTHER_USER = "qbatch-test-other"
# The client as another user runs: one POST of a job, its status and body printed (standard library only).
CLIENT = """
import http.client, json, sys
port, body, headers = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
connection.request("POST", "/v1/qbatch/runs", body=body, headers={"Content-Type": "application/json", **headers})
response = connection.getresponse()
print(response.status)
print(response.read(65536).decode())
"""


def _port(base_url: str) -> int:
    return int(base_url.rsplit(":", 1)[1].split("/")[0])


def _post(port: int, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", RUN_ROUTE, body=json.dumps(body),
                           headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.readline() or b"{}")
    finally:
        connection.close()


def test_forwarded_headers_are_never_trusted(make_service):
    """A header naming another address changes nothing: the socket's peer is the client (uvicorn's
    proxy_headers off), so a remote address in X-Forwarded-For is not believed either way."""
    base_url, _ = make_service()
    body = {"values": {}, "qbatch_version": "0"}
    for header in ("X-Forwarded-For", "Forwarded", "X-Real-IP"):
        status, answer = _post(_port(base_url), body, {header: "10.0.0.5"})
        assert status == 409 and "this client qbatch 0" in answer["error"]["message"], (header, answer)


def test_a_client_whose_socket_has_no_owner_is_refused(tmp_path, monkeypatch):
    """Fail closed: a socket the system does not list (or a system that does not say) is no proof of a user."""
    from qbatch.serve import runs

    monkeypatch.setattr(runs.sockets, "PROC_TCP", (str(tmp_path / "none"),))
    with pytest.raises(runs.RunRefused, match="cannot tell which user"):  # netlink: no such socket
        runs.check_client("127.0.0.1", port=5001, server_port=8000)

    def no_netlink(*ends):
        raise runs.sockets.Unavailable("no netlink here")

    monkeypatch.setattr(runs.sockets, "netlink_owner", no_netlink)  # nor /proc/net/tcp: a system that does not say
    with pytest.raises(runs.RunRefused) as refused:
        runs.check_client("127.0.0.1", port=5001, server_port=8000)
    assert refused.value.status == 403
    assert refused.value.body()["error"] == {
        "message": "the service cannot tell which user the request comes from (the system does not name the "
                   "owner of the client's socket); a service without an API key serves its own user only",
        "type": "invalid_request_error", "param": None, "code": "unknown_user", "exit_code": 2, "where": None,
        "hint": "start `qbatch serve` with --api-key KEY (or QBATCH_API_KEY) and pass the same key"}
    with pytest.raises(runs.RunRefused, match="cannot tell which user"):
        runs.check_client("127.0.0.1", port=None, server_port=8000)  # a client without a port (a forged one: 0)
    runs.check_client("127.0.0.1", port=5001, server_port=8000, keyed=True)  # the key is the proof


def _other_user_python() -> list[str]:
    """A test user, and a Python it can run (the suite's may sit in root's home); skips where that is not so."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("runuser"):
        pytest.skip("needs root, useradd and runuser: the test runs a client as another Unix user")
    if subprocess.run(["id", OTHER_USER], capture_output=True).returncode != 0:
        made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
                              capture_output=True, text=True)
        if made.returncode not in (0, 9):  # 9: made meanwhile
            pytest.skip(f"useradd failed: {made.stderr.strip()}")
    for python in dict.fromkeys([sys.executable, shutil.which("python3"), "/usr/bin/python3"]):
        if python and subprocess.run(["runuser", "-u", OTHER_USER, "--", python, "-c", "pass"],
                                     capture_output=True).returncode == 0:
            return ["runuser", "-u", OTHER_USER, "--", python]
    pytest.skip(f"no Python that {OTHER_USER} may run")


def test_another_users_job_is_refused_even_with_a_forged_header(make_service, tmp_path):
    """Another Unix user asks the service (root here) to read a file only the service's user may read: 403,
    with or without `X-Forwarded-For: 127.0.0.1`, and nothing is written."""
    as_other = _other_user_python()
    base_url, _ = make_service()
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"id": "s", "prompt": "the service user's secret"}) + "\n")
    secret.chmod(0o600)
    out = f"/tmp/qbatch-test-{uuid.uuid4().hex}"  # a folder anyone may create
    from qbatch.versions import __version__

    body = json.dumps({"values": {"inputs": [str(secret)], "output_dir": out}, "qbatch_version": __version__})
    try:
        for headers in ({"X-Forwarded-For": "127.0.0.1"}, {}):
            done = subprocess.run([*as_other, "-c", CLIENT, str(_port(base_url)), body, json.dumps(headers)],
                                  capture_output=True, text=True, timeout=60, cwd="/")
            status, first = (done.stdout.splitlines() + ["", ""])[:2]  # a job taken: its first NDJSON line
            error = json.loads(first or "{}").get("error", {})
            assert status == "403" and error["code"] == "other_user", done.stdout + done.stderr
            assert error["type"] == "invalid_request_error" and "from another user" in error["message"]
            assert not os.path.exists(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_what_the_service_writes_is_private_to_its_user(make_service, cli, tmp_path, monkeypatch):
    """A job's output folder (it holds what the service's user could read) and the data folder (every client's
    batches) are 0700: the files in them are out of other users' reach."""
    base_url, service = make_service()
    assert stat.S_IMODE(service.settings.data_dir.stat().st_mode) == 0o700
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    (tmp_path / "shared").mkdir(mode=0o755)
    (tmp_path / "shared" / "out").mkdir(mode=0o755)  # one the client made: made private too
    server = ("--progress", "none", "--server", base_url.removesuffix("/v1"))
    for out in ("out/new", "shared/out"):
        result = cli("run", "rows.jsonl", "-o", out, *server)
        assert result.exit_code == 0, result.stderr
        assert stat.S_IMODE((tmp_path / out).stat().st_mode) == 0o700, out
    (tmp_path / "out/new").chmod(0o755)  # a qbatch output folder (a local run's): made private as it resumes
    assert cli("run", "rows.jsonl", "-o", "out/new", *server).exit_code == 0
    assert stat.S_IMODE((tmp_path / "out/new").stat().st_mode) == 0o700

    (tmp_path / "shared" / "notes.txt").write_text("someone's")  # someone's folder: refused, left as it is
    refused = cli("run", "rows.jsonl", "-o", "shared", *server)
    assert refused.exit_code == 2 and "Traceback" not in refused.stderr
    assert (f"Error: the output folder holds other files and is open to other users (mode 0755); the service "
            f"makes a job's output folder private to its user ({tmp_path / 'shared'})") in refused.stderr
    assert "Hint: pass a new -o/--output-dir, or run without --server" in refused.stderr
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o755
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["notes.txt", "out"]


GET = """
import http.client, sys
connection = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=30)
connection.request("GET", sys.argv[2])
response = connection.getresponse()
print(response.status)
print(response.read(65536).decode())
"""


def test_without_a_key_another_user_cannot_read_the_batches_either(make_service):
    """The Batch API holds what the service's user uploaded and its outputs: without an API key, another
    Unix user gets a 403 on every route but /health (the same rule as for jobs)."""
    from tests.serve.conftest import client_for, requests_jsonl, run_to_end

    as_other = _other_user_python()
    base_url, _ = make_service()
    batch = run_to_end(client_for(base_url), requests_jsonl(2))  # the service's own user: served
    for path, status in ((f"/v1/files/{batch.output_file_id}/content", "403"), ("/v1/files", "403"),
                         ("/v1/batches", "403"), ("/health", "200")):
        done = subprocess.run([*as_other, "-c", GET, str(_port(base_url)), path], capture_output=True, text=True,
                              timeout=60, cwd="/")
        answer, text = done.stdout.split("\n", 1)
        assert answer == status, (path, done.stdout, done.stderr)
        if status == "403":
            assert json.loads(text)["error"]["code"] == "other_user"
