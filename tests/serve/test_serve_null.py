"""`qbatch serve` through the official openai SDK, on the null engine (no model runs): the API's
objects and lifecycle, pagination, bad inputs, authentication, concurrent clients, expiry."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.serve.conftest import client_for, lines_of, requests_jsonl, run_to_end, wait_until


def test_batch_lifecycle_through_the_sdk(make_service):
    base_url, _ = make_service()
    client = client_for(base_url)
    file = client.files.create(file=("in.jsonl", requests_jsonl(6)), purpose="batch")
    assert file.object == "file" and file.purpose == "batch" and file.id.startswith("file-") and file.bytes > 0
    assert client.files.retrieve(file.id).filename == "in.jsonl"
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.id.startswith("batch_") and batch.status in ("in_progress", "validating")
    assert batch.request_counts.total == 6 and batch.metadata == {"job": "nightly"}
    done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, 60)
    assert done.request_counts.completed == 6 and done.request_counts.failed == 0
    assert done.completed_at >= done.in_progress_at >= done.created_at and done.error_file_id is None
    output = lines_of(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{i}" for i in range(6))
    first = output[0]
    assert first["error"] is None and first["response"]["status_code"] == 200
    assert first["response"]["body"]["object"] == "chat.completion"
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert client.files.delete(file.id).deleted is True
    with pytest.raises(openai.NotFoundError, match="no such file"):
        client.files.retrieve(file.id)
    assert [m.id for m in client.models.list()] == [done.model]


def test_completions_rows_and_failed_rows_go_to_their_files(make_service):
    base_url, _ = make_service()
    client = client_for(base_url)
    data = requests_jsonl(3, url="/v1/completions") + b'{"custom_id": "empty", "url": "/v1/completions", "body": {"prompt": ""}}\n'
    done = run_to_end(client, data, endpoint="/v1/completions")
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
    output = lines_of(client, done.output_file_id)
    assert {line["response"]["body"]["object"] for line in output} == {"text_completion"}
    errors = lines_of(client, done.error_file_id)
    assert [(e["custom_id"], e["response"]) for e in errors] == [("empty", None)]
    assert errors[0]["error"]["code"] == "empty_prompt"


def test_lines_for_another_endpoint_fail_the_batch_with_their_line_numbers(make_service):
    base_url, _ = make_service()
    client = client_for(base_url)
    data = requests_jsonl(2) + requests_jsonl(1, url="/v1/completions", prefix="other")
    file = client.files.create(file=("mixed.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.code, e.line, e.param) for e in batch.errors.data] == [("invalid_url", 3, "url")]


def test_list_batches_pages_newest_first(make_service):
    base_url, _ = make_service()
    client = client_for(base_url)
    ids = [run_to_end(client, requests_jsonl(1, prefix=f"b{i}")).id for i in range(5)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]
    assert len(client.files.list().data) == 10  # 5 inputs, 5 outputs


def test_batch_past_its_completion_window_expires(make_service):
    base_url, _ = make_service(window_s=1e-3)
    client = client_for(base_url)
    done = run_to_end(client, requests_jsonl(3))
    assert done.status == "expired" and done.expired_at is not None and done.output_file_id is None
    errors = lines_of(client, done.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"req-{i}", "batch_expired") for i in range(3)]


BAD_FILES = {
    "non-JSONL": (b"custom_id,prompt\na,hello\n", "line 1 is not valid JSON"),
    "duplicate custom_id": (requests_jsonl(2) + requests_jsonl(1), "duplicate custom_id 'req-0' on line 3"),
    "unknown endpoint in a line": (requests_jsonl(1, url="/v1/moderations"), "line 1: unsupported url '/v1/moderations'"),
    "empty file": (b"\n", "the file holds no requests"),
    "too many requests": (requests_jsonl(6), "more than 5 requests"),
}


def _raw(base_url: str, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, base_url + path, timeout=30, **kwargs)


def _assert_error(response: httpx.Response, status: int, message: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and message in error["message"]
    assert "Traceback" not in response.text


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_are_refused_at_upload(make_service, name):
    base_url, _ = make_service(max_requests=5)
    data, message = BAD_FILES[name]
    _assert_error(_raw(base_url, "POST", "/files", files={"file": ("x.jsonl", data)}, data={"purpose": "batch"}),
                  400, message)
    assert httpx.get(base_url.removesuffix("/v1") + "/health", timeout=10).status_code == 200


def test_bad_requests_are_4xx_in_openais_shape_and_the_service_keeps_serving(make_service):
    base_url, _ = make_service(max_upload_bytes=2000)
    client = client_for(base_url)
    good = client.files.create(file=("in.jsonl", requests_jsonl(2)), purpose="batch")
    cases = [
        (_raw(base_url, "POST", "/files", files={"file": ("x.jsonl", requests_jsonl(2))},
              data={"purpose": "fine-tune"}), 400, "purpose must be 'batch'"),
        (_raw(base_url, "POST", "/files", content=b"not multipart",
              headers={"content-type": "multipart/form-data; boundary=xyz"}), 400, "file"),
        (_raw(base_url, "POST", "/files", content=b"{}", headers={"content-type": "application/json"}), 400, "file"),
        (_raw(base_url, "POST", "/files", files={"file": ("x.jsonl", requests_jsonl(200))},
              data={"purpose": "batch"}), 413, "over this service's limit of 2000 bytes"),
        (_raw(base_url, "POST", "/batches", json={"input_file_id": good.id, "endpoint": "/v1/moderations",
                                                 "completion_window": "24h"}), 400, "unsupported endpoint"),
        (_raw(base_url, "POST", "/batches", json={"input_file_id": good.id, "endpoint": "/v1/chat/completions",
                                                 "completion_window": "1h"}), 400, "completion_window"),
        (_raw(base_url, "POST", "/batches", content=b"{oops", headers={"content-type": "application/json"}),
         400, "not JSON"),
        (_raw(base_url, "POST", "/batches", json={"input_file_id": "file-" + "0" * 24,
                                                 "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
         404, "no such file"),
        # %2F is decoded before routing: such a path matches no route
        (_raw(base_url, "GET", "/files/..%2F..%2Fetc%2Fpasswd"), 404, "no route GET"),
        (_raw(base_url, "GET", "/files/file-..%2F..%2Fetc%2Fpasswd/content"), 404, "no route GET"),
        (_raw(base_url, "GET", "/files/..passwd"), 400, "not a valid file_id"),
        (_raw(base_url, "DELETE", "/files/file-%2E%2E"), 400, "not a valid file_id"),
        (_raw(base_url, "GET", "/batches/batch_%2E%2E"), 400, "not a valid batch_id"),
        (_raw(base_url, "GET", "/batches?after=../../x"), 400, "not a valid after"),
        (_raw(base_url, "GET", "/batches?limit=many"), 400, "invalid request"),
        (_raw(base_url, "GET", "/nowhere"), 404, "no route GET"),
    ]
    for response, status, message in cases:
        _assert_error(response, status, message)
    for path_like in ("../../etc/passwd", "etc/passwd", "file-x%00", "batch_../x"):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as raised:
            client.files.content(path_like)
        assert raised.value.body["message"].startswith(("no route", "'"))
    assert run_to_end(client, requests_jsonl(2)).status == "completed"  # still serving


def test_api_key_required_off_loopback_and_checked(make_service, cli):
    from qbatch.errors import SpecError
    from qbatch.serve.config import ServeSettings

    with pytest.raises(SpecError, match="binding 0.0.0.0 exposes the service"):
        ServeSettings(__import__("pathlib").Path("unused"), {"model": "m"}, host="0.0.0.0")
    result = cli("serve", "--data-dir", "unused-dir", "--host", "0.0.0.0", "--backend", "null")
    assert result.exit_code == 2 and "Hint: pass --api-key KEY" in result.stderr
    base_url, _ = make_service(api_key="s3cret")
    _assert_error(_raw(base_url, "GET", "/batches"), 401, "missing or wrong API key")
    with pytest.raises(openai.AuthenticationError):
        client_for(base_url, api_key="wrong").batches.list()
    assert client_for(base_url, api_key="s3cret").batches.list().data == []
    assert httpx.get(base_url.removesuffix("/v1") + "/health", timeout=10).json()["status"] == "ok"  # health needs no key


def test_concurrent_clients_all_complete(make_service):
    base_url, _ = make_service()
    results: list = []
    failures: list = []

    def client_thread(t: int) -> None:
        client = client_for(base_url)
        try:
            for b in range(4):
                done = run_to_end(client, requests_jsonl(3, prefix=f"t{t}b{b}"))
                results.append((done.status, sorted(line["custom_id"] for line in lines_of(client, done.output_file_id))))
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=client_thread, args=(t,)) for t in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert failures == [] and len(results) == 20
    assert all(status == "completed" and len(ids) == 3 for status, ids in results)


def test_latency_benchmark_script_prints_json(make_service, capsys):
    import json
    import runpy

    base_url, _ = make_service()
    script = runpy.run_path(str(__import__("pathlib").Path(__file__).parents[2] / "benchmarks" / "serve_latency.py"))
    script["main"](["--base-url", base_url, "--rows", "3", "--repeats", "2", "--throughput-rows", "5",
                    "--max-tokens", "4", "--prompt-words", "5", "--timeout-s", "60"])
    report = json.loads(capsys.readouterr().out)
    assert [r["rows_ok"] for r in report["latency_runs"]] == [3, 3] and report["throughput"]["rows_ok"] == 5
    assert report["latency_create_to_download_s"]["median"] > 0


def test_airflow_serve_dag_is_valid_python():
    import ast
    from pathlib import Path

    source = (Path(__file__).parents[2] / "jobs" / "airflow_serve_dag.py").read_text()
    tree = ast.parse(source)
    names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert "submit_and_wait" in names and "client.batches.create" in source


def test_a_second_signal_while_the_worker_finishes_exits_at_once(bundled_model, tmp_path):
    """SIGTERM lets the worker finish its chunk; a second SIGTERM while it does must not wait for it.
    The worker here never finishes (its stop() does nothing), as one deep in a long chunk."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    from tests.serve.conftest import ROOT, free_port

    script = tmp_path / "serve.py"
    script.write_text(
        "import sys\n"
        "from pathlib import Path\n"
        "from qbatch.log import setup\n"
        "from qbatch.serve.config import ServeSettings\n"
        "from qbatch.serve.server import Service\n"
        "setup()\n"
        f"service = Service(ServeSettings(Path({str(tmp_path / 'data')!r}), {{'model': {bundled_model!r}, "
        f"'backend': 'null'}}, {{'progress': 'none'}}, port={free_port()}))\n"
        "service.worker.stop = lambda: None\n"
        "service.serve()\n")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any("listening on" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        time.sleep(2)  # uvicorn has stopped; the worker is being waited for
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 128 + signal.SIGTERM
        reader.join(5)
        assert "second signal, exiting now" in "".join(lines)
    finally:
        proc.kill()


def test_ctrl_c_stops_the_service_quietly(serve_process, bundled_model, tmp_path):
    """SIGINT (Ctrl-C) is a graceful stop like SIGTERM: uvicorn took our first SIGINT for its second and
    force-exited, its lifespan task cancelled with a CancelledError traceback on stderr (seen on every Ctrl-C)."""
    import signal
    import urllib.request

    from tests.serve.conftest import wait_until

    base, proc = serve_process("--model", bundled_model, "--backend", "null", data_dir=tmp_path / "data")

    def up() -> bool:
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=2):
                return True
        except OSError:
            return False

    wait_until(up, 60)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) is not None
    log = next(tmp_path.glob("serve-*.log")).read_text()
    assert "SIGINT: finishing the current chunk" in log and "serve: stopped" in log
    assert "Traceback" not in log and "CancelledError" not in log, log
