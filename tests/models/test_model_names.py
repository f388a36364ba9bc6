"""Model names that are neither a folder nor the bundled model: a misspelt alias is named at once,
and without the hub a model outside the local Hugging Face cache fails in seconds (not after the
hub client's retries), while a cached one loads from its folder and resumes as the same model."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from qbatch.errors import EXIT_INPUT, ModelError
from qbatch.models import registry as models


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No hub, and an empty Hugging Face cache of this test's own."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(models, "hub_reachable", lambda: False)
    return cache


def _cache_copy(cache, folder: str, repo: str) -> None:
    """`folder` as the cached snapshot of hub model `repo` (huggingface_hub's layout)."""
    commit = "0" * 40
    entry = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, entry / "snapshots" / commit)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)


def test_a_misspelt_bundled_name_is_named_at_once(cli, write_jsonl, monkeypatch):
    monkeypatch.setattr(models, "hub_reachable", lambda: pytest.fail("the hub was asked about an alias"))
    path = write_jsonl([{"prompt": "hi"}])
    for name in ("smollm2-135", "SmolLM2-135m", "smolm2-135m"):
        result = cli("run", path, "-o", "unused", "--model", name, "--dry-run")
        assert result.exit_code == EXIT_INPUT
        assert result.stderr.splitlines() == [f"Error: unknown model '{name}': not a folder, and not the bundled "
                                              "smollm2-135m", "Hint: did you mean --model smollm2-135m?"]


def test_offline_a_model_outside_the_cache_fails_in_seconds(cli, write_jsonl, offline, bundled_model):
    from huggingface_hub import constants

    _cache_copy(offline, bundled_model, "HuggingFaceTB/SmolLM2-135M-Instruct")
    path = write_jsonl([{"prompt": "hi"}])
    started = time.monotonic()
    result = cli("run", path, "-o", "unused", "--model", "Qwen/Qwen3-0.6B", "--dry-run")
    assert time.monotonic() - started < 10
    assert result.exit_code == EXIT_INPUT
    assert result.stderr.splitlines() == [
        f"Error: model 'Qwen/Qwen3-0.6B' is not in the local Hugging Face cache ({offline}), and "
        f"{constants.ENDPOINT} cannot be reached",
        "Hint: use --model smollm2-135m (bundled, works offline) or a local model folder"]
    result = cli("run", path, "-o", "unused", "--model", "HuggingFaceTB/SmolLM2-135M-Instruc", "--dry-run")
    assert result.stderr.splitlines()[-1] == "Hint: did you mean --model HuggingFaceTB/SmolLM2-135M-Instruct?"


def test_offline_a_cached_model_runs_from_its_folder_as_the_same_model(cli, write_jsonl, offline, bundled_model,
                                                                       monkeypatch, tmp_path):
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    _cache_copy(offline, bundled_model, repo)
    folder = models.resolve(repo)
    # the fingerprint's model is the name's, as when vLLM loads it from the hub: online and offline runs resume
    assert folder.startswith(str(offline)) and models.model_identity(repo, folder) == models.model_identity(repo, repo)
    monkeypatch.setattr(models, "hub_reachable", lambda: True)
    assert models.resolve(repo) == repo  # online: the name, as vLLM takes it
    monkeypatch.setattr(models, "hub_reachable", lambda: False)
    path, out = write_jsonl([{"id": str(i), "prompt": "hi"} for i in range(3)]), tmp_path / "out"
    result = cli("run", path, "-o", out, "--model", repo, "--backend", "null", "--progress", "none", "--limit", "2")
    assert result.exit_code == 0, result.output
    result = cli("run", path, "-o", out, "--model", repo, "--backend", "null", "--progress", "none")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "stats.json").read_text())["rows_skipped"] == 2


def test_a_partial_cached_copy_is_not_a_model(offline, bundled_model):
    _cache_copy(offline, bundled_model, "org/partial")
    for weights in (offline / "models--org--partial" / "snapshots").glob("*/*.safetensors"):
        weights.unlink()
    with pytest.raises(ModelError, match="'org/partial' is not in the local Hugging Face cache"):
        models.resolve("org/partial")


def test_the_hub_probe_gives_up_within_its_timeout(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    models.hub_reachable.cache_clear()
    try:
        started = time.monotonic()
        assert models.hub_reachable() is False and time.monotonic() - started < 1
    finally:
        models.hub_reachable.cache_clear()
