"""`qbatch serve` accounts for every request as OpenAI does (null engine): a batch that ends has each of its
requests in the output or the error file, counts that add up, its token usage, and cancelling a batch
that has ended is an error."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest

from tests.serve.conftest import client_for, lines_of, requests_jsonl, run_to_end, slow_null_engine, wait_until


def _create(client, data: bytes):
    file = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")


def test_a_batch_cancelled_before_it_ran_reports_each_request(make_service, monkeypatch):
    base_url, service = make_service()
    worker, release = service.worker, threading.Event()
    run = worker._session_run
    monkeypatch.setattr(worker, "_session_run", lambda data, **settings: release.wait(60) and run(data, **settings))
    client = client_for(base_url)
    running = _create(client, requests_jsonl(2, prefix="a"))
    wait_until(lambda: worker._current == running.id, 30)
    waiting = _create(client, requests_jsonl(8, prefix="b"))

    cancelled = client.batches.cancel(waiting.id)
    assert cancelled.status == "cancelled" and cancelled.output_file_id is None
    counts = cancelled.request_counts
    assert (counts.total, counts.completed, counts.failed) == (8, 0, 8)
    assert [(e["custom_id"], e["error"]["code"]) for e in lines_of(client, cancelled.error_file_id)] == [
        (f"b-{i}", "batch_cancelled") for i in range(8)]
    assert cancelled.usage.total_tokens == 0
    with pytest.raises(openai.ConflictError, match=r"Cannot cancel a batch with status 'cancelled'\."):
        client.batches.cancel(waiting.id)

    release.set()
    done = wait_until(lambda: (b := client.batches.retrieve(running.id)).status == "completed" and b, 60)
    with pytest.raises(openai.ConflictError, match=r"Cannot cancel a batch with status 'completed'\.") as raised:
        client.batches.cancel(running.id)
    assert raised.value.status_code == 409 and raised.value.body["type"] == "invalid_request_error"
    assert client.batches.retrieve(running.id).status == "completed"
    assert done.request_counts.completed == 2


def test_a_running_batch_cancelled_keeps_the_requests_it_finished(make_service):
    """A cancel stops the running batch within about a second (its run's stop request, seen as the engine
    reports): the requests done by then are in the output file, each other one gets batch_cancelled."""
    from qbatch.engines.pool import EnginePool

    engine = slow_null_engine()
    base_url, _ = make_service(pool=EnginePool(start=lambda *args, **kwargs: engine))
    client = client_for(base_url)
    running = _create(client, requests_jsonl(500, prefix="c"))  # 10 s of work
    wait_until(lambda: client.batches.retrieve(running.id).request_counts.completed > 0, 30, 0.05)
    asked = time.monotonic()
    assert client.batches.cancel(running.id).status in ("cancelling", "cancelled")
    done = wait_until(lambda: (b := client.batches.retrieve(running.id)).status == "cancelled" and b, 30, 0.05)
    assert time.monotonic() - asked < 5
    kept = [line["custom_id"] for line in lines_of(client, done.output_file_id)]
    not_run = [(e["custom_id"], e["error"]["code"]) for e in lines_of(client, done.error_file_id)]
    assert 0 < len(kept) < 500 and done.request_counts.completed == len(kept)
    assert sorted(kept + [cid for cid, _ in not_run]) == sorted(f"c-{i}" for i in range(500))
    assert {code for _, code in not_run} == {"batch_cancelled"} and done.request_counts.failed == len(not_run)


def test_usage_adds_up_the_output_files_tokens(make_service):
    base_url, _ = make_service()
    client = client_for(base_url)
    two = {"custom_id": "two", "method": "POST", "url": "/v1/chat/completions",
           "body": {"messages": [{"role": "user", "content": "twice"}], "max_completion_tokens": 3, "n": 2}}
    done = run_to_end(client, requests_jsonl(3, max_tokens=5) + (json.dumps(two) + "\n").encode())
    assert done.status == "completed"
    usages = [line["response"]["body"]["usage"] for line in lines_of(client, done.output_file_id)]
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in usages) > 0
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in usages) == 3 * 5 + 2 * 3
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    assert done.usage.input_tokens_details.cached_tokens == 0 and done.usage.output_tokens_details.reasoning_tokens == 0


def test_an_expired_batch_reports_each_request(make_service):
    base_url, _ = make_service(window_s=1e-3)
    done = run_to_end(client_for(base_url), requests_jsonl(3))
    assert done.status == "expired"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 0, 3)
    assert done.usage is not None and done.usage.total_tokens == 0
