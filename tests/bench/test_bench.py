"""`qbatch bench`: synthetic workloads (fast) and a small side-by-side run on the real engine (slow)."""

from __future__ import annotations

import json
import statistics

import pytest

from qbatch.bench.workloads import WORKLOADS, make_workload, sample_lengths
from qbatch.errors import EXIT_USAGE


def test_uniform_lengths_are_fixed():
    assert set(sample_lengths("uniform", 50)) == {(512, 256)}


def test_varied_lengths_follow_the_issue_and_stay_in_bounds():
    lengths = sample_lengths("varied", 4096)
    prompts, outputs = [p for p, _ in lengths], [o for _, o in lengths]
    assert 270 <= statistics.mean(prompts) <= 330 and 16 <= min(prompts) and max(prompts) <= 2048
    assert 190 <= statistics.mean(outputs) <= 240 and 8 <= min(outputs) and max(outputs) <= 1024
    assert len(set(prompts)) > 500  # really varied


def test_short_lengths_are_classification_like():
    lengths = sample_lengths("short", 1000)
    assert all(150 <= p <= 250 and 1 <= o <= 8 for p, o in lengths)
    assert 190 <= statistics.mean(p for p, _ in lengths) <= 210


def test_small_is_a_notebook_job():
    """200 rows of ~190 prompt tokens and 256 output tokens: the job a warm Session serves."""
    rows = sample_lengths("small", 200)
    assert all(170 <= p <= 210 and o == 256 for p, o in rows)


def test_lengths_are_seeded_and_scaled():
    assert sample_lengths("varied", 20, seed=1) == sample_lengths("varied", 20, seed=1)
    assert sample_lengths("varied", 20, seed=1) != sample_lengths("varied", 20, seed=2)
    assert set(sample_lengths("uniform", 3, scale=0.25)) == {(128, 64)}
    assert all(o >= 1 for _, o in sample_lengths("short", 100, scale=0.01))


@pytest.fixture(scope="module")
def tokenizer(bundled_model):
    from qbatch.inputs.prepare import load_tokenizer

    return load_tokenizer(bundled_model)


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_prompts_have_the_sampled_token_counts(tokenizer, name):
    workload = make_workload(name, tokenizer, 40, scale=0.5)
    expected = sample_lengths(name, 40, scale=0.5)
    lengths = [len(ids) for ids in workload.prompt_token_ids]
    floor = min(lengths)  # the chat template alone plus one word: the shortest possible prompt
    assert lengths == [max(p, floor) for p, _ in expected]
    assert workload.max_tokens == [o for _, o in expected]
    if workload.task == "generate":  # an embedding workload's texts go as they are (test_bench_embed.py)
        assert all(p.startswith("<|im_start|>") for p in workload.prompts)  # chat-templated, as qbatch sends them


def test_qbatch_tokenizes_the_jsonl_exactly_like_the_raw_modes(tokenizer, bundled_model, tmp_path):
    """`qbatch` and `vllm-tokens` must see the same token ids, or the comparison is void."""
    from qbatch.jobs.job import Job
    from qbatch.spec import JobSpec

    workload = make_workload("varied", tokenizer, 30, scale=0.2)
    path = workload.write_jsonl(tmp_path / "varied.jsonl")
    spec = JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, "ignore_eos": True})
    requests = [r for item in Job.setup(spec).work(set()) for r in item]
    by_id = {r.id: r for r in requests}
    assert len(by_id) == 30
    for i, (ids, max_tokens) in enumerate(zip(workload.prompt_token_ids, workload.max_tokens, strict=True)):
        request = by_id[f"varied-{i}"]
        assert request.prompt_token_ids == ids
        assert request.sampling["max_tokens"] == max_tokens and request.sampling["ignore_eos"] is True


def test_null_engine_pipeline_bench_reports_speed_and_memory(cli, bundled_model, tmp_path):
    out = tmp_path / "bench.json"
    result = cli("bench", "--null-engine", "--model", bundled_model, "--rows", 500, "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    r = report["results"]
    assert report["kind"] == "pipeline" and r["rows"] == 500
    assert r["pipeline_rows_per_s"] > 0 and r["rss_peak_mb"] >= r["rss_start_mb"] > 0
    assert r["tokenize_rendered_rows_per_s"] > 0 and r["vs_tokenize_rendered"] > 0
    assert "null-engine pipeline, 500 rows" in result.output


def test_inputs_only_writes_the_workload_files(cli, bundled_model, tmp_path):
    result = cli("bench", "varied", "short", "--model", bundled_model, "--rows", 5, "--inputs-only",
                 "--work-dir", tmp_path)
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "varied.jsonl").read_text().splitlines()
    assert len(lines) == 5 and set(json.loads(lines[0])) == {"id", "prompt", "max_tokens"}
    assert (tmp_path / "short.jsonl").is_file() and not (tmp_path / "uniform.jsonl").exists()


def test_unknown_mode_names_the_valid_ones(cli, bundled_model):
    result = cli("bench", "--model", bundled_model, "--modes", "vllm-tokens,sglang")
    assert result.exit_code == EXIT_USAGE
    assert "mode must be one of vllm-text, vllm-tokens, qbatch, session, hf; got 'sglang'" in result.output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_every_mode_does_the_same_work(cli, tiny_qwen3, tmp_path):
    """The benchmark never rots: every mode runs on the tiny Qwen3 and generates exactly the forced tokens."""
    out = tmp_path / "bench.json"
    result = cli("bench", "varied", "--model", tiny_qwen3, "--rows", 6, "--length-scale", 0.05, "--hf-rows", 2,
                 "--modes", "vllm-text,vllm-tokens,qbatch,session,hf", "--variant", "engines_per_gpu=2", "--repeats", 2,
                 "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["results"]}
    assert set(rows) == {"hf", "vllm-text", "vllm-tokens", "qbatch", "session", "qbatch engines_per_gpu=2"}
    expected = report["workloads"]["varied"]
    for mode in ("vllm-tokens", "qbatch", "session", "qbatch engines_per_gpu=2"):
        assert rows[mode]["rows"] == 6
        assert rows[mode]["output_tokens"] == expected["output_tokens"]  # ignore_eos + per-row max_tokens
        assert rows[mode]["prompt_tokens"] == expected["prompt_tokens"]  # the same prompts
    assert rows["vllm-text"]["output_tokens"] == expected["output_tokens"]
    assert rows["vllm-tokens"]["vs_vllm_tokens"] == 1.0
    assert rows["qbatch"]["notes"]["engine_start_s"] < 1  # the engine was reused, not started again
    assert rows["session"]["notes"]["engine_start_s"] < 1  # the Session found the same warm engine
    assert 0 < rows["session"]["notes"]["overhead_s"] < rows["session"]["wall_s"]
    # two engines of its own, started after the shared one had gone and before the timing
    two = rows["qbatch engines_per_gpu=2"]["notes"]
    assert two["engines"] == 2 and two["engine_start_s"] < 1 and two["own_engines_start_s"] > 1
    assert rows["hf"]["rows"] == 2
    assert len(rows["qbatch"]["notes"]["wall_s_runs"]) == 2  # two runs, in alternating order
    assert "vs vllm-tokens" in result.output
    runs = " ".join(f"{w:.2f}" for w in rows["qbatch"]["notes"]["wall_s_runs"])
    assert any(line.startswith("varied") and line.endswith(runs) for line in result.output.splitlines())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vllm_defaults_against_qbatch_on_its_own_engine(cli, tiny_qwen3, tmp_path):
    """The headline comparison in one command: raw vLLM on its defaults, qbatch on its own engine and settings."""
    out = tmp_path / "bench.json"
    result = cli("bench", "varied", "--model", tiny_qwen3, "--rows", 4, "--length-scale", 0.05,
                 "--modes", "vllm-text,qbatch", "--vllm-defaults", "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["results"]}
    assert report["engine"]["settings"]["vllm_defaults"] is True
    expected = report["workloads"]["varied"]["output_tokens"]
    assert rows["vllm-text"]["output_tokens"] == rows["qbatch"]["output_tokens"] == expected
    # not the defaults engine: one of qbatch's own, started after that one had gone and before the timing
    # (here possibly an engine an earlier test left in qbatch.engines.factory's cache)
    assert "own_engines_start_s" in rows["qbatch"]["notes"] and rows["qbatch"]["notes"]["engine_start_s"] < 1
    assert rows["qbatch"]["vs_vllm_tokens"] is None
    assert rows["qbatch"]["vs_vllm_text"] == round(rows["qbatch"]["output_tok_s"] / rows["vllm-text"]["output_tok_s"], 3)
    assert "vs vllm-text" in result.output
