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


def test_the_bundled_model_is_prepared_once_with_one_line_and_no_progress_bars(bundled_model, tmp_path, monkeypatch,
                                                                                capfd, caplog):
    """A fresh machine's first run converts the bundled GGUF file: qbatch says so in one line, and
    Transformers' progress bars (reading, loading, writing the weights) stay off the terminal."""
    import logging

    monkeypatch.setenv("QBATCH_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="qbatch"):
        folder = models.resolve("smollm2-135m")
    assert folder == str(tmp_path / "models" / "smollm2-135m")
    assert (tmp_path / "models" / "smollm2-135m" / "config.json").is_file()
    out, err = capfd.readouterr()
    assert "GGUF" not in err + out and "%|" not in err + out, err + out
    assert [r.getMessage() for r in caplog.records if "bundled model" in r.getMessage()] == \
        [f"preparing the bundled model smollm2-135m (once on this machine): its weights converted into {folder}"]
    caplog.clear()
    assert models.resolve("smollm2-135m") == folder and not caplog.records  # converted once


def test_a_models_architectures_and_family_come_from_its_config(tmp_path):
    """One reader of config.json: the architectures (which engines get qbatch's fused Qwen3 class, whether a
    model is a decoder) and the family (its reasoning parser, from a multimodal model's text part too)."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    assert models.architectures(str(tmp_path)) == ["Qwen3ForCausalLM"]
    assert models.reasoning_parser(str(tmp_path)) == "qwen3"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], "text_config": {"model_type": "qwen3"}}))
    assert models.reasoning_parser(str(tmp_path)) == "qwen3"
    (tmp_path / "config.json").write_text("[1, 2]")  # no JSON object: nothing to read, as without a file
    assert models.architectures(str(tmp_path)) is None and models.four_bit_method(str(tmp_path)) is None
    assert models.architectures(str(tmp_path / "Qwen/Qwen3-0.6B")) is None  # a hub name
