"""`qbatch run --server URL`: the job handed to a `qbatch serve` (uvicorn in a thread, null engine) gives what
the same command gives here; refusals and a service that is not there are clear errors with their exit codes."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from tests.serve.conftest import ROOT, free_port, slow_null_engine, wait_until

ROWS = 12


@pytest.fixture
def work(tmp_path, monkeypatch):
    """The client's folder (its cwd) with prompts.jsonl: relative paths in the commands mean it."""
    folder = tmp_path / "client"
    folder.mkdir()
    lines = [json.dumps({"id": f"r{i}", "prompt": f"say {i} " * (i + 1)}) for i in range(ROWS)]
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(folder)
    return folder


def _server(base_url: str) -> str:
    return base_url.removesuffix("/v1")


def _rows(folder: Path) -> list[tuple]:
    frame = pl.read_parquet(folder / "results.parquet")
    return sorted(frame.select("id", "text", "prompt_tokens").iter_rows())


def _counts(stdout: str) -> list[str]:
    """The summary's count lines (timings differ between runs)."""
    return [line for line in stdout.splitlines() if line.strip().startswith(("rows ", "tokens", "qbatch run"))]


def _fake_pool_service(make_service, engine):
    from qbatch.engines.pool import EnginePool

    return make_service(pool=EnginePool(start=lambda *args, **kwargs: engine))


def test_a_server_run_gives_the_local_runs_results_and_resumes_either_way(make_service, cli, run_null, work):
    base_url, _ = make_service()
    local = run_null("prompts.jsonl", "-o", "out/local", "--max-tokens", "7")
    remote = cli("run", "prompts.jsonl", "-o", "out/remote", "--max-tokens", "7", "--progress", "none",
                 "--server", _server(base_url))
    assert local.exit_code == 0 and remote.exit_code == 0, remote.stderr
    assert _rows(work / "out/remote") == _rows(work / "out/local") and len(_rows(work / "out/local")) == ROWS
    assert _counts(remote.stdout) == _counts(local.stdout)
    assert "  results  " in remote.stdout and " out/remote/results.parquet (12 rows)" in remote.stdout  # as given

    again = cli("run", "prompts.jsonl", "-o", "out/remote", "--max-tokens", "7", "--progress", "none",
                "--server", _server(base_url))
    assert again.exit_code == 0 and re.search(rf"rows already done +{ROWS}\n", again.stdout)
    here = run_null("prompts.jsonl", "-o", "out/remote", "--max-tokens", "7")  # the same fingerprint: resumes
    assert here.exit_code == 0 and re.search(rf"rows already done +{ROWS}\n", here.stdout), here.stderr


def test_exit_codes_and_messages_are_the_local_runs(make_service, cli, work):
    base_url, _ = make_service()
    server = ("--server", _server(base_url), "--progress", "none")
    (work / "bad.jsonl").write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": ""}\n')
    failed = cli("run", "bad.jsonl", "-o", "out/bad", "--fail-on-row-errors", *server)
    assert failed.exit_code == 4 and re.search(r"rows failed \(this run\) +1 ", failed.stdout)

    missing = cli("run", "missing.jsonl", "-o", "out/missing", *server)
    assert missing.exit_code == 3
    assert f"Error: input file not found ({work / 'missing.jsonl'})" in missing.stderr

    other = cli("run", "prompts.jsonl", "-o", "out/other", "--max-model-len", "64", *server)
    assert other.exit_code == 2 and "Traceback" not in other.stderr
    assert "the service runs max_model_len None; this job asks for 64" in other.stderr
    assert "Hint: run it without --server, or start a service with that setting" in other.stderr
    assert not (work / "out/other").exists()


def test_a_service_that_is_not_there_fails_fast_with_exit_6(cli, work):
    started = time.monotonic()
    result = cli("run", "prompts.jsonl", "-o", "out/x", "--server", f"http://127.0.0.1:{free_port()}")
    assert result.exit_code == 6 and time.monotonic() - started < 5
    assert "Error: cannot reach the qbatch service at http://127.0.0.1:" in result.stderr
    assert "(connection refused) (--server)" in result.stderr and "drop --server" in result.stderr

    elsewhere = cli("run", "prompts.jsonl", "-o", "out/x", "--server", "http://example.com:8000")
    assert elsewhere.exit_code == 2 and "must be a service on this machine" in elsewhere.stderr


def test_a_url_that_is_no_qbatch_service_and_a_wrong_key_are_named(make_service, cli, work):
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    other = HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        result = cli("run", "prompts.jsonl", "-o", "out/x", "--server", f"http://127.0.0.1:{other.server_port}")
    finally:
        other.shutdown()
    assert result.exit_code == 6 and "is not a qbatch service that takes jobs (HTTP 404" in result.stderr

    base_url, _ = make_service(api_key="secret")
    wrong = cli("run", "prompts.jsonl", "-o", "out/x", "--server", _server(base_url), "--api-key", "nope")
    assert wrong.exit_code == 2 and "wrong or missing API key" in wrong.stderr
    assert "Hint: pass --api-key KEY or set QBATCH_API_KEY" in wrong.stderr
    right = cli("run", "prompts.jsonl", "-o", "out/x", "--server", _server(base_url), "--api-key", "secret",
                "--progress", "none")
    assert right.exit_code == 0, right.stderr


def test_only_loopback_clients_and_only_the_clients_version(make_service, monkeypatch):
    from fastapi.testclient import TestClient

    from qbatch.serve import runs
    from qbatch.serve.runs import check_client
    from qbatch.serve.wire import RUN_ROUTE

    _, service = make_service()
    body = {"values": {"inputs": ["/x.jsonl"], "output_dir": "/tmp/x"}, "qbatch_version": "0"}
    answer = TestClient(service.app).post(RUN_ROUTE, json=body)  # its client address is "testclient"
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "not_loopback"
    for host in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        check_client(host, keyed=True)
    with pytest.raises(Exception, match="from this machine only"):
        check_client("10.0.0.5")

    monkeypatch.setattr(runs.sockets, "owner", lambda *ends: os.getuid())  # TestClient has no socket
    local = TestClient(service.app, client=("127.0.0.1", 5000))
    answer = local.post(RUN_ROUTE, json=body)
    assert answer.status_code == 409 and "this client qbatch 0" in answer.json()["error"]["message"]


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_owner_of_a_clients_socket_is_found(host):
    """By netlink's exact lookup and by /proc/net/tcp alike; the server's end of the connection is not the client's."""
    import socket

    from qbatch.serve.sockets import PROC_TCP, netlink_owner, owner, proc_owner

    family = socket.AF_INET if "." in host else socket.AF_INET6
    with socket.create_server((host, 0), family=family) as server, \
            socket.create_connection(server.getsockname()[:2]) as client:
        ends = client.getsockname()[:2], server.getsockname()[:2]
        assert owner(*ends) == netlink_owner(*ends) == proc_owner(ends[0][1], ends[1][1], PROC_TCP) == os.getuid()
        assert netlink_owner((host, ends[0][1] + 1), ends[1]) is None  # no such socket
    assert proc_owner(1, 2, ("/nonexistent/tcp",)) is None  # a system that does not say


def test_an_ipv4_client_of_a_dual_stack_service_is_found():
    """A dual-stack socket shows an IPv4 client as ::ffff:127.0.0.1: its socket is looked up as IPv4."""
    import socket

    from qbatch.serve.sockets import netlink_owner

    if not socket.has_dualstack_ipv6():
        pytest.skip("no dual-stack IPv6 here")
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as server, \
            socket.create_connection(("127.0.0.1", server.getsockname()[1])) as _:
        connection, peer = server.accept()
        with connection:
            assert peer[0] == "::ffff:127.0.0.1"
            assert netlink_owner(peer[:2], connection.getsockname()[:2]) == os.getuid()


def test_the_owner_lookup_does_not_read_the_whole_tcp_table(monkeypatch):
    """/proc/net/tcp is read (the whole table: milliseconds, on every request) only where netlink cannot answer."""
    import socket

    from qbatch.serve import sockets

    monkeypatch.setattr(sockets, "PROC_TCP", ("/nonexistent/tcp",))
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        assert sockets.owner(client.getsockname(), server.getsockname()) == os.getuid()
        monkeypatch.setattr(sockets, "netlink_owner", _no_netlink)
        assert sockets.owner(client.getsockname(), server.getsockname()) is None


def test_without_an_api_key_jobs_come_from_the_services_own_user_only(tmp_path, monkeypatch):
    from qbatch.serve import runs

    other = os.getuid() + 1000
    table = tmp_path / "tcp"
    table.write_text("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
                     f"   0: 0100007F:1388 0100007F:1F40 01 00000000:00000000 00:00000000 00000000 {other} 0 1 1\n")
    monkeypatch.setattr(runs.sockets, "PROC_TCP", (str(table),))
    monkeypatch.setattr(runs.sockets, "netlink_owner", _no_netlink)  # a system that has only /proc/net/tcp
    with pytest.raises(runs.RunRefused, match=f"another user \\(uid {other}\\)") as refused:
        runs.check_client("127.0.0.1", port=5000, server_port=8000)
    assert refused.value.status == 403 and "--api-key" in refused.value.error.hint
    runs.check_client("127.0.0.1", port=5000, server_port=8000, keyed=True)  # the key is the proof
    with pytest.raises(runs.RunRefused, match="cannot tell which user"):
        runs.check_client("127.0.0.1", port=5001, server_port=8000)  # a socket the system does not list


def test_an_output_folder_the_service_cannot_write_is_refused_before_any_row(make_service, cli, work, monkeypatch):
    base_url, service = make_service()
    locked, secret = work / "locked", work / "secret.jsonl"
    locked.mkdir()
    secret.write_text((work / "prompts.jsonl").read_text())
    if os.geteuid() == 0:  # root reads and writes anywhere: the check itself, with the access it would be denied
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) in (locked, secret) else real(p, mode))
    else:
        locked.chmod(0o500)
        secret.chmod(0o000)
    try:
        result = cli("run", "prompts.jsonl", "-o", "locked/out", "--server", _server(base_url))
        assert result.exit_code == 2
        assert f"cannot write here ({locked})" in result.stderr and not (locked / "out").exists()
        inside = cli("run", "prompts.jsonl", "-o", str(service.settings.data_dir / "mine"), "--server",
                     _server(base_url))
        assert inside.exit_code == 2 and "inside the service's own data folder" in inside.stderr
        unreadable = cli("run", "secret.jsonl", "-o", "out/secret", "--server", _server(base_url))
        assert unreadable.exit_code == 2 and f"cannot read this input ({secret})" in unreadable.stderr
        assert not (work / "out/secret").exists()
    finally:
        locked.chmod(0o700)
        secret.chmod(0o600)


def test_embed_and_dry_run_go_to_the_service_too(make_service, cli, work):
    base_url, _ = make_service()
    plan = cli("run", "prompts.jsonl", "-o", "out/plan", "--dry-run", "--server", _server(base_url))
    assert plan.exit_code == 0 and "dry run (no model loaded)" in plan.stdout and not (work / "out/plan").exists()
    assert "plan (what the engines would get, and why)" in plan.stdout  # the service's plan, read back
    assert "rows valid" in cli("run", "prompts.jsonl", "--dry-run", "--server", _server(base_url)).stdout  # no -o
    vectors = cli("embed", "prompts.jsonl", "-o", "out/vectors", "--progress", "none", "--server", _server(base_url))
    assert vectors.exit_code == 0, vectors.stderr
    assert "qbatch embed completed" in vectors.stdout
    assert pl.read_parquet(work / "out/vectors/results.parquet")["embedding"].len() == ROWS


def test_standard_input_is_refused_with_a_hint(make_service, cli, work):
    base_url, _ = make_service()
    result = cli("run", "-", "-o", "out/x", "--server", _server(base_url))
    assert result.exit_code == 2 and "a service reads its inputs from files" in result.stderr


def _many_rows(folder: Path, n: int = 400) -> None:
    lines = [json.dumps({"id": f"m{i}", "prompt": f"row {i}"}) for i in range(n)]
    (folder / "many.jsonl").write_text("\n".join(lines) + "\n")


def _manifest(folder: Path) -> dict:
    path = folder / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}


def test_a_client_that_goes_away_stops_its_run_and_a_rerun_resumes(make_service, work):
    from qbatch.serve.client import absolute_paths
    from qbatch.serve.wire import RUN_ROUTE, RunRequest
    from qbatch.versions import __version__

    base_url, _ = _fake_pool_service(make_service, slow_null_engine())
    _many_rows(work)
    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    values = absolute_paths({"inputs": ["many.jsonl"], "output_dir": "out/gone", "progress": "bar"}, work)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", RUN_ROUTE, body=RunRequest(values, __version__, bar=True).to_json(),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    while (item := json.loads(response.readline() or b'{"end": 1}')).get("progress", {}).get("done", 0) == 0:
        assert "end" not in item and "summary" not in item
    connection.close()  # killed: the service finds it gone at its next line
    gone = time.monotonic()
    manifest = wait_until(lambda: _manifest(work / "out/gone").get("status") == "interrupted"
                          and _manifest(work / "out/gone"), 30, 0.05)
    assert time.monotonic() - gone < 5 and manifest["runs"][-1].get("interrupted_by") == "client gone"


def test_ctrl_c_on_the_client_exits_130_and_stops_the_run(make_service, work):
    """The command as a user runs it (a subprocess): the bar's log lines on stderr, Ctrl-C's message and exit."""
    base_url, _ = _fake_pool_service(make_service, slow_null_engine())
    _many_rows(work)
    proc = subprocess.Popen([sys.executable, "-m", "qbatch.cli", "run", "many.jsonl", "-o", "out/c", "--server",
                             _server(base_url), "--progress", "log"], cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wait_until(lambda: (work / "out/c/manifest.json").exists() or proc.poll() is not None, 60, 0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert "Error: interrupted by SIGINT (out/c): finished parts are kept" in stderr and stdout == ""
    assert "engine ready" in stderr  # the run's own lines, from the service
    # the client exits once the service let go of the folder: a rerun at once finds it free, as after a local run
    assert _manifest(work / "out/c").get("status") == "interrupted"

    done = subprocess.run([sys.executable, "-m", "qbatch.cli", "run", "many.jsonl", "-o", "out/c", "--server",
                           _server(base_url), "--progress", "none"], cwd=work, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "qbatch run completed" in done.stdout and "rows already done" in done.stdout
    assert pl.read_parquet(work / "out/c/results.parquet").height == 400


def test_lines_the_run_logs_from_its_reading_threads_reach_the_client(make_service, work):
    """A line the job logs from the threads that read and encode its rows (here: its rows share documents)
    reaches the client (a subprocess) as a local run prints it; the service's own lines do not."""
    documents = ["".join(f"document {d}, sentence {i}. " for i in range(40)) for d in range(4)]
    rows = [{"id": f"d{d}q{q}", "prompt": f"{text}\nQuestion {q}?"}
            for d, text in enumerate(documents) for q in range(3)]
    (work / "docs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    base_url, _ = make_service()
    done = subprocess.run([sys.executable, "-m", "qbatch.cli", "run", "docs.jsonl", "-o", "out/docs", "--server",
                           _server(base_url), "--progress", "log", "--max-tokens", "4"], cwd=work, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "rows share long prompt prefixes (a document asked several questions)" in done.stderr
    assert "serve:" not in done.stderr


def test_a_job_runs_with_its_own_adapters_not_the_services(make_service, cli, run_null, bundled_model, work, tmp_path):
    """A service started with --lora: a job without --lora keeps its `adapter` column as plain data, as a local
    run does, and either resumes the other's folder; a job with --lora runs with its own adapters."""
    from qbatch.bench.adapters import write_random_adapter

    one = write_random_adapter(tmp_path / "one", bundled_model, rank=8, seed=1)
    two = write_random_adapter(tmp_path / "two", bundled_model, rank=8, seed=2)
    base_url, _ = make_service({"model": bundled_model, "backend": "null", "lora": {"one": str(one)}})
    rows = [{"id": f"a{i}", "prompt": f"say {i}", "adapter": ["two", "wizard", "one"][i % 3]} for i in range(6)]
    (work / "tagged.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    server = ("--server", _server(base_url), "--progress", "none", "--max-tokens", "5")

    plain = cli("run", "tagged.jsonl", "-o", "out/plain", *server)
    assert plain.exit_code == 0, plain.stderr
    assert re.search(r"rows ok \(this run\) +6\n", plain.stdout)
    assert pl.read_parquet(work / "out/plain/errors.parquet").height == 0
    assert sorted(pl.read_parquet(work / "out/plain/results.parquet")["adapter"]) == sorted(r["adapter"] for r in rows)
    local = run_null("tagged.jsonl", "-o", "out/plain", "--max-tokens", "5")  # the same job: it resumes
    assert local.exit_code == 0 and re.search(r"rows already done +6\n", local.stdout), local.stderr

    own = cli("run", "tagged.jsonl", "-o", "out/own", "--lora", f"two={two}", *server)
    assert own.exit_code == 0, own.stderr
    errors = pl.read_parquet(work / "out/own/errors.parquet")
    assert sorted(errors["id"]) == ["a1", "a2", "a4", "a5"]  # wizard and one: not this job's adapters
    assert set(errors["error"]) == {"unknown_adapter"}
    same = cli("run", "tagged.jsonl", "-o", "out/same", "--lora", f"one={one}", *server)  # the service's own
    assert same.exit_code == 0, same.stderr
    assert sorted(pl.read_parquet(work / "out/same/errors.parquet")["id"]) == ["a0", "a1", "a3", "a4"]


def test_a_seed_travels_to_the_service_and_seeds_each_row_as_here(make_service, cli, run_null, work):
    base_url, _ = make_service()
    remote = cli("run", "prompts.jsonl", "-o", "out/seeded", "--seed", "7", "--max-tokens", "5", "--progress", "none",
                 "--server", _server(base_url))
    assert remote.exit_code == 0, remote.stderr
    assert json.loads((work / "out/seeded/manifest.json").read_text())["fingerprint"]["settings"]["seed"] \
        == "row seeds from 7"
    local = run_null("prompts.jsonl", "-o", "out/seeded", "--seed", "7", "--max-tokens", "5")
    assert local.exit_code == 0 and re.search(rf"rows already done +{ROWS}\n", local.stdout), local.stderr
    other = run_null("prompts.jsonl", "-o", "out/seeded", "--seed", "8", "--max-tokens", "5")
    assert other.exit_code == 5  # the seed is the job's: another one is another job


def test_a_job_files_single_string_inputs_is_one_path(make_service, cli, work):
    base_url, _ = make_service()
    (work / "job.toml").write_text('inputs = "prompts.jsonl"\noutput_dir = "out/job"\nmax_tokens = 5\n')
    result = cli("run", "--job", "job.toml", "--progress", "none", "--server", _server(base_url))
    assert result.exit_code == 0, result.stderr
    assert pl.read_parquet(work / "out/job/results.parquet").height == ROWS

    # a key spelled with dashes, as a job file may: the same setting, a path made absolute, an engine's compared
    (work / "dashed.toml").write_text('inputs = ["prompts.jsonl"]\noutput-dir = "out/dashed"\n')
    dashed = cli("run", "--job", "dashed.toml", "--progress", "none", "--server", _server(base_url))
    assert dashed.exit_code == 0, dashed.stderr
    assert pl.read_parquet(work / "out/dashed/results.parquet").height == ROWS
    (work / "engine.toml").write_text('inputs = "prompts.jsonl"\noutput_dir = "out/engine"\nmax-model-len = 64\n')
    engine = cli("run", "--job", "engine.toml", "--progress", "none", "--server", _server(base_url))
    assert engine.exit_code == 2 and "the service runs max_model_len None; this job asks for 64" in engine.stderr


def _no_netlink(*ends):
    from qbatch.serve.sockets import Unavailable

    raise Unavailable("no netlink here")
