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
