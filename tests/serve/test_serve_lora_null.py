"""`qbatch serve --lora NAME=PATH`: /v1/models lists the adapters beside the base model, as vLLM's server
lists its --lora-modules (batch lines pick one by body.model: tests/jobs/test_lora_null.py)."""

from __future__ import annotations

import json

from qbatch.bench.adapters import write_random_adapter


def test_serve_lists_the_adapters_as_models(make_service, bundled_model, tmp_path):
    adapters = {name: write_random_adapter(tmp_path / name, bundled_model, rank=8, seed=seed)
                for name, seed in (("one", 1), ("two", 2))}
    import urllib.request

    base_url, _ = make_service({"model": bundled_model, "backend": "null",
                                "lora": {name: str(folder) for name, folder in adapters.items()}})
    with urllib.request.urlopen(f"{base_url}/models") as response:
        models = json.loads(response.read())
    assert [m["id"] for m in models["data"]] == [bundled_model.rstrip("/").rsplit("/", 1)[-1], "one", "two"]
    assert models["data"][1]["parent"] == models["data"][0]["id"]


def test_a_batch_runs_beside_an_adapter_whose_weights_are_unusable(make_service, bundled_model, tmp_path):
    from tests.serve.conftest import client_for, lines_of, run_to_end

    good = write_random_adapter(tmp_path / "good", bundled_model, rank=8, seed=1)
    bad = write_random_adapter(tmp_path / "bad", bundled_model, rank=8, seed=2)
    (bad / "adapter_model.safetensors").write_bytes(b"")  # vLLM would die loading it, and the batch with it
    base_url, _ = make_service({"model": bundled_model, "backend": "null", "lora": {"good": str(good), "bad": str(bad)}})
    lines = [{"custom_id": model or "base", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4,
                       **({"model": model} if model else {})}} for model in (None, "good", "bad")]
    client = client_for(base_url)
    done = run_to_end(client, "".join(json.dumps(line) + "\n" for line in lines).encode())
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    assert sorted(line["custom_id"] for line in lines_of(client, done.output_file_id)) == ["base", "good"]
    (error,) = lines_of(client, done.error_file_id)
    assert error["custom_id"] == "bad" and error["error"]["code"] == "bad_adapter"
    assert error["error"]["message"].startswith(f"adapter bad ({bad}): adapter_model.safetensors cannot be read")
