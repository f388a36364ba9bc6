"""`qbatch bench embed`: the embedding workload and its settings (fast: no engine)."""

from __future__ import annotations

import json
import statistics

import pytest

from qbatch.bench.settings import BenchSettings, qbatch_spec
from qbatch.bench.workloads import make_workload, sample_lengths
from qbatch.errors import SpecError


def test_embed_lengths_are_passages_without_output():
    lengths = sample_lengths("embed", 4000)
    prompts = [p for p, _ in lengths]
    assert all(o == 0 for _, o in lengths) and 16 <= min(prompts) and max(prompts) <= 1024
    assert 220 <= statistics.mean(prompts) <= 290


def test_embed_workload_is_raw_text_tokenized_as_qbatch_embed_does(bundled_model, tmp_path):
    from qbatch.jobs.job import Job

    from qbatch.tokens import load_tokenizer

    tokenizer = load_tokenizer(bundled_model)
    workload = make_workload("embed", tokenizer, 40, scale=0.25)
    assert workload.task == "embed" and workload.prompts == workload.texts and workload.num_output_tokens == 0
    path = workload.write_jsonl(tmp_path / "embed.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(rows[0]) == {"id", "prompt"}  # no max_tokens column to carry into the results
    spec = qbatch_spec(BenchSettings(["embed"], run_settings={"model": bundled_model, "backend": "null"}), path,
                       tmp_path / "out")
    assert spec.engine.task == "embed"
    job = Job.setup(spec)
    requests = [r for item in job.work(set()) for r in item]
    assert {r.id: r.prompt_token_ids for r in requests} == {
        f"embed-{i}": ids for i, ids in enumerate(workload.prompt_token_ids)}


def test_embed_runs_alone_on_its_modes():
    with pytest.raises(SpecError, match="the embed workload runs on an embedding engine"):
        BenchSettings(["embed", "varied"]).validate()
    with pytest.raises(SpecError, match="mode hf has no embedding counterpart"):
        BenchSettings(["embed"], modes=["qbatch", "hf"]).validate()
    BenchSettings(["embed"]).validate()
