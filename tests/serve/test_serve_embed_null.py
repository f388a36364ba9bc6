"""`qbatch serve` runs /v1/embeddings batches as `qbatch embed` jobs (null engine: no model runs)."""

from __future__ import annotations

import json

from tests.serve.conftest import client_for, lines_of, run_to_end


def embedding_lines(n: int) -> bytes:
    lines = [{"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "any", "input": f"passage {i}"}} for i in range(n)]
    lines.append({"custom_id": "two", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["a", "b"]}})
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def test_an_embeddings_batch_gives_openai_embedding_responses(make_service):
    base_url, _ = make_service()
    client = client_for(base_url)
    done = run_to_end(client, embedding_lines(3), endpoint="/v1/embeddings")
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
    output = {line["custom_id"]: line for line in lines_of(client, done.output_file_id)}
    assert sorted(output) == ["e-0", "e-1", "e-2"]
    body = output["e-1"]["response"]["body"]
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    assert len(body["data"][0]["embedding"]) == 576 and body["model"] == done.model  # the bundled model's size
    errors = lines_of(client, done.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("two", "bad_body")]
