"""The model's context length, read without importing Transformers where config.json says it."""

from __future__ import annotations

import json
import shutil

import pytest

from qbatch.models import registry as models


@pytest.mark.parametrize("model", ["bundled_model", "tiny_qwen3"])
def test_context_length_from_config_json_is_what_autoconfig_says(model, request, monkeypatch):
    import transformers

    path = request.getfixturevalue(model)
    expected = transformers.AutoConfig.from_pretrained(path).max_position_embeddings
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: pytest.fail("Transformers used"))
    assert models.model_max_len(path, None) == expected


def test_a_config_without_the_length_falls_back_to_autoconfig(tiny_qwen3, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen3, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["max_position_embeddings"]
    (folder / "config.json").write_text(json.dumps(config))
    assert models.model_max_len(str(folder), None) == 32768  # Qwen3Config's default
