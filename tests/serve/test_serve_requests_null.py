"""What `qbatch serve` takes from a batch file's lines (null engine): requests keyed by custom_id alone, a
leading byte-order mark, and every body key applied or refused for its request, never dropped."""

from __future__ import annotations

import json

from tests.serve.conftest import client_for, lines_of, requests_jsonl, run_to_end


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"say {custom_id}"}], "max_completion_tokens": 4, **body}}


def test_requests_are_keyed_by_custom_id_whatever_else_a_line_holds(make_service):
    """Some tools write a top-level `id` too: it is ignored, as OpenAI ignores it, even when lines repeat it."""
    base_url, _ = make_service()
    client = client_for(base_url)
    lines = [{**chat_line(f"c-{i}"), "id": "same"} for i in range(3)] + [{**chat_line("c-3"), "id": 7}]
    done = run_to_end(client, jsonl(lines))
    assert done.status == "completed", done.errors
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 4, 0)
    assert sorted(line["custom_id"] for line in lines_of(client, done.output_file_id)) == ["c-0", "c-1", "c-2", "c-3"]


def test_a_file_that_starts_with_a_byte_order_mark_runs(make_service):
    """Windows tools write a UTF-8 BOM: the upload check and the run read the file alike, BOM and all."""
    base_url, _ = make_service()
    client = client_for(base_url)
    done = run_to_end(client, b"\xef\xbb\xbf" + requests_jsonl(3))
    assert done.status == "completed", done.errors
    assert sorted(line["custom_id"] for line in lines_of(client, done.output_file_id)) == ["req-0", "req-1", "req-2"]


def test_every_body_key_is_applied_or_fails_its_request(make_service):
    base_url, _ = make_service()
    client = client_for(base_url)
    lines = [
        chat_line("plain", model="gpt-4o-mini", user="u1", store=False, tools=None, stream=False),
        chat_line("biased", logit_bias={"15": 100, "16": -100}, ignore_eos=True),
        chat_line("bad-bias", logit_bias={"token": 5}),
        chat_line("bias-range", logit_bias={"15": 101}),
        chat_line("tools", tools=[{"type": "function", "function": {"name": "f"}}]),
        chat_line("streamed", stream=True),
    ]
    done = run_to_end(client, jsonl(lines))
    assert done.status == "completed", done.errors
    assert sorted(line["custom_id"] for line in lines_of(client, done.output_file_id)) == ["biased", "plain"]
    errors = {line["custom_id"]: line["error"] for line in lines_of(client, done.error_file_id)}
    assert errors == {
        "bad-bias": {"code": "bad_param", "message": "logit_bias keys must be token ids (integers >= 0), got 'token'"},
        "bias-range": {"code": "bad_param", "message": "logit_bias values must be numbers in [-100, 100], got 101 "
                                                        "for token '15'"},
        "tools": {"code": "unsupported_parameter", "message": "body.tools is not supported by qbatch; leave it out"},
        "streamed": {"code": "unsupported_parameter",
                     "message": "body.stream is not supported by qbatch; leave it out"},
    }


def test_an_embeddings_body_key_qbatch_does_not_apply_fails_its_request(make_service):
    base_url, _ = make_service()
    client = client_for(base_url)
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/embeddings", "body": {"input": "text", **body}}
             for name, body in (("ok", {"model": "m", "encoding_format": "float"}), ("extra", {"truncate": True}))]
    done = run_to_end(client, jsonl(lines), endpoint="/v1/embeddings")
    assert [line["custom_id"] for line in lines_of(client, done.output_file_id)] == ["ok"]
    assert [(e["custom_id"], e["error"]["code"]) for e in lines_of(client, done.error_file_id)] == [
        ("extra", "unsupported_parameter")]
