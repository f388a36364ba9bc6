"""What `qbatch serve` tells API clients (null engine): no error names a server path or a CLI flag (the client
sees neither), whatever went wrong; a route the service does not have lists its routes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve.conftest import client_for, lines_of, requests_jsonl, run_to_end

FLAG = re.compile(r"(?<![\w-])--[a-z]")


def assert_for_clients(texts: list[str], *paths) -> None:
    for text in texts:
        assert not FLAG.search(text), text
        assert not any(str(path) in text for path in paths), text
        assert "Traceback" not in text, text


def _post_file(base_url: str, data: bytes) -> httpx.Response:
    return httpx.post(base_url + "/files", files={"file": ("x.jsonl", data)}, data={"purpose": "batch"}, timeout=30)


def test_no_error_names_a_server_path_or_a_cli_flag(make_service, bundled_model, tmp_path, monkeypatch):
    from qbatch.errors import EngineError

    base_url, service = make_service({"model": bundled_model, "backend": "null", "max_model_len": 64},
                                     max_upload_bytes=20_000, max_requests=50)
    client = client_for(base_url)
    data_dir = service.settings.data_dir
    assert [model.id for model in client.models.list()] == [Path(bundled_model).name]  # a folder's name, no path
    texts = [_post_file(base_url, data).text for data in (
        b"\xff\xfe not utf-8\n", b"[1, 2]\n", requests_jsonl(2) + requests_jsonl(1), requests_jsonl(51),
        requests_jsonl(200), b'{"custom_id": "a", "url": "/v1/chat/completions", "body": []}\n')]
    texts.append(_post_file(base_url, requests_jsonl(1000)).text)  # over the limit by its Content-Length
    assert all(json.loads(text)["error"]["message"] for text in texts)

    # a request too long for the model: its error line
    long = {"custom_id": "long", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "word " * 200}]}}
    done = run_to_end(client, requests_jsonl(1) + (json.dumps(long) + "\n").encode())
    errors = lines_of(client, done.error_file_id)
    assert [e["error"]["code"] for e in errors] == ["prompt_too_long"]
    assert errors[0]["error"]["message"].startswith("prompt has ")
    texts += [e["error"]["message"] for e in errors]
    assert done.model == Path(bundled_model).name

    # a run that fails, as the engine's, and one an internal error stops: the log has their details
    for failure in (EngineError("the engine failed: out of memory", where=str(data_dir / "batches"),
                                hint="pass --gpu-memory-utilization 0.5"),
                    OSError(28, "No space left on device", str(data_dir / "batches" / "x"))):
        def fail(data, failure=failure, **settings):
            raise failure
        monkeypatch.setattr(service.worker, "_session_run", fail)
        failed = run_to_end(client, requests_jsonl(3, prefix="f"))
        assert failed.status == "failed"
        assert (failed.request_counts.total, failed.request_counts.completed, failed.request_counts.failed) == (3, 0, 3)
        assert [e["error"]["code"] for e in lines_of(client, failed.error_file_id)] == ["batch_failed"] * 3
        texts += [e.message for e in failed.errors.data]
    assert [e.code for e in failed.errors.data] == ["internal_error"]

    with pytest.raises(openai.ConflictError) as raised:
        client.batches.cancel(done.id)
    texts.append(raised.value.message)
    assert_for_clients(texts, data_dir, tmp_path)


def test_a_service_whose_engines_failed_says_so_without_their_paths(make_service, tmp_path):
    missing = tmp_path / "no-such-model"
    base_url, service = make_service({"model": str(missing), "backend": "null"})
    assert service.worker.failed and str(missing) in service.worker.failed  # the log has it
    health = httpx.get(base_url.removesuffix("/v1") + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert health.json()["error"] == "the engines did not start; the service's log says why"


def test_a_route_the_service_does_not_have_lists_its_routes(make_service):
    base_url, _ = make_service()
    response = httpx.post(base_url + "/responses", json={"model": "m", "input": "hi"}, timeout=10)
    message = response.json()["error"]["message"]
    assert response.status_code == 404 and message.startswith(
        "no route POST /v1/responses: this service has OpenAI's Batch API and its online routes (chat, completions, "
        "embeddings)")
    for route in ("POST /v1/files", "GET /v1/files/{file_id}/content", "POST /v1/batches",
                  "POST /v1/batches/{batch_id}/cancel", "GET /v1/models", "GET /health", "POST /v1/chat/completions",
                  "POST /v1/completions", "POST /v1/embeddings"):
        assert route in message
    for method, path, status in (("POST", "/moderations", 404), ("GET", "/responses", 404), ("DELETE", "/batches", 405)):
        response = httpx.request(method, base_url + path, timeout=10)
        assert response.status_code == status and "its routes: " in response.json()["error"]["message"]
