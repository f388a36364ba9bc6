"""Seeds, n > 1 accounting and the structured-output engine settings, without a model: a job seed's
per-row seeds, the summary and stats counting rows and samples apart, and the checks and engine
arguments of --structured-outputs-backend, --disable-any-whitespace and --thinking-token-budget."""

from __future__ import annotations

import json

import polars as pl
import pytest

from qbatch.errors import EXIT_USAGE
from qbatch.sampling import ROW_SEED_BITS, row_seed



def _requests(bundled_model, path, **settings):
    from qbatch.jobs.job import Job
    from qbatch.spec import JobSpec

    spec = JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, **settings})
    return {r.id: r for item in Job.setup(spec).work(set()) for r in item}


def test_a_job_seed_gives_each_row_its_own_seed(bundled_model, write_jsonl):
    path = write_jsonl([{"id": "a", "prompt": "same"}, {"id": "b", "prompt": "same"},
                        {"id": "own", "prompt": "same", "seed": 7}])
    seeded = _requests(bundled_model, path, seed=3)
    assert seeded["a"].sampling["seed"] == row_seed(3, "a") != seeded["b"].sampling["seed"] == row_seed(3, "b")
    assert seeded["own"].sampling["seed"] == 7  # a row's own seed is used as given
    assert _requests(bundled_model, path, seed=3)["a"].sampling == seeded["a"].sampling  # the same on a rerun
    assert _requests(bundled_model, path, seed=4)["a"].sampling["seed"] != seeded["a"].sampling["seed"]
    assert "seed" not in _requests(bundled_model, path)["a"].sampling  # no job seed: none derived


def test_row_seeds_leave_room_for_vllms_sample_offsets():
    # vLLM seeds sample i of a request with seed + i, as an int64
    seeds = [row_seed(s, str(i)) for s in (0, 1, 2**40) for i in range(2000)]
    assert len(set(seeds)) == len(seeds) and max(seeds) < 2**ROW_SEED_BITS
    assert row_seed(0, "x") == row_seed(0, "x") and row_seed(0, "1") != row_seed(1, "0")


def test_the_seed_enters_the_fingerprint(run_null, write_jsonl, tmp_path):
    path, out = write_jsonl([{"id": "a", "prompt": "x"}]), tmp_path / "out"
    assert run_null(path, "-o", out, "--seed", "1").exit_code == 0
    result = run_null(path, "-o", out, "--seed", "2")
    assert result.exit_code == 5 and "seed was 'row seeds from 1', now 'row seeds from 2'" in result.output


def test_n_samples_count_as_rows_and_samples_and_every_samples_tokens(run_null, write_jsonl, tmp_path):
    path, out = write_jsonl([{"id": f"r{i}", "prompt": "x"} for i in range(4)]), tmp_path / "out"
    result = run_null(path, "-o", out, "--n", "3", "--max-tokens", "5")
    assert result.exit_code == 0, result.output
    assert "rows ok (this run)              4, 12 samples" in result.output
    assert "(4 rows, 12 samples)" in result.output
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["rows_ok"], stats["samples_ok"], stats["completion_tokens"]) == (4, 12, 4 * 3 * 5)
    assert (stats["total_ok"], stats["total_samples"]) == (4, 12)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"] == {"rows_ok": 4, "rows_failed": 0, "samples_ok": 12}
    assert pl.read_parquet(out / "results.parquet")["completion_tokens"].sum() == stats["completion_tokens"]


def test_one_sample_a_row_keeps_the_summary_as_it_was(run_null, write_jsonl, tmp_path):
    out = tmp_path / "out"
    result = run_null(write_jsonl([{"id": "a", "prompt": "x"}]), "-o", out)
    assert result.exit_code == 0 and "samples" not in result.output
    assert json.loads((out / "manifest.json").read_text())["counts"] == {"rows_ok": 1, "rows_failed": 0}


def test_merged_shards_with_n_samples_check_out(run_null, cli, write_jsonl, tmp_path):
    # merge compares a shard's recorded rows_ok with the ids in its parts: rows, not samples
    path = write_jsonl([{"id": f"r{i}", "prompt": "x"} for i in range(10)])
    for shard in ("0/2", "1/2"):
        assert run_null(path, "-o", tmp_path / shard.replace("/", "-"), "--n", "2", "--shard", shard).exit_code == 0
    result = cli("merge", tmp_path / "0-2", tmp_path / "1-2", "-o", tmp_path / "merged")
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(tmp_path / "merged" / "results.parquet").height == 20
    status = json.loads(cli("status", tmp_path / "merged", "--json").stdout)
    assert (status["rows_done"], status["rows_total"]) == (10, 10)  # rows, not samples


@pytest.mark.parametrize(("flags", "message"), [
    (["--structured-outputs-backend", "outlines", "--disable-any-whitespace"],
     "Error: disable_any_whitespace works with the xgrammar and guidance backends only (vLLM's rule), "
     "got structured_outputs_backend outlines"),
    (["--structured-outputs-backend", "auto", "--disable-any-whitespace"], "got structured_outputs_backend auto"),
    (["--structured-outputs-backend", "nope"], "Invalid value for '--structured-outputs-backend'"),
    (["--thinking-token-budget", "-2"], "Error: thinking_token_budget must be >= 0, or -1 for unlimited"),
    (["--thinking-token-budget", "8"], "Error: --thinking-token-budget needs a reasoning parser"),
])
def test_bad_structured_settings_exit_2_before_the_model_loads(run_null, write_jsonl, tmp_path, flags, message):
    result = run_null(write_jsonl([{"id": "a", "prompt": "x"}]), "-o", tmp_path / "out", *flags)
    assert result.exit_code == EXIT_USAGE, result.output
    assert message in result.output


def test_structured_settings_are_vllms_engine_arguments():
    from qbatch.plan import Machine, ModelFacts
    from qbatch.plan.engine_args import llm_kwargs
    from qbatch.spec import EngineSpec

    machine = Machine(ModelFacts("/m"), platform="cuda", gpu_capability=8)
    kwargs, _ = llm_kwargs(EngineSpec(structured_outputs_backend="xgrammar", disable_any_whitespace=True,
                                      reasoning_parser="qwen3"), 4096, machine)
    assert kwargs["structured_outputs_config"] == {"backend": "xgrammar", "disable_any_whitespace": True,
                                                   "reasoning_parser": "qwen3"}
    assert kwargs["reasoning_parser"] == "qwen3" and kwargs["seed"] == 0
    plain, why = llm_kwargs(EngineSpec(seed=5), 4096, machine)
    assert "reasoning_parser" not in plain
    # a job's seed seeds its rows (qbatch.sampling.row_seed), not the engine: runs of other seeds share it
    assert plain["seed"] == 0 and why["seed"] == "rows carry their own seeds (--seed)"


@pytest.mark.parametrize(("settings", "fast_tokenizer", "tuned", "expected"), [
    # qbatch's default, constrained job or not (one engine for every call of a Session or a service)
    ({}, True, True, {"backend": "guidance", "disable_any_whitespace": True, "disable_additional_properties": True}),
    ({"disable_any_whitespace": False}, True, True,
     {"backend": "guidance", "disable_any_whitespace": False, "disable_additional_properties": True}),
    ({"structured_outputs_backend": "auto"}, True, True, {"backend": "auto"}),  # the job's backend wins
    ({"structured_outputs_backend": "guidance"}, True, True, {"backend": "guidance"}),
    ({}, False, True, None),  # guidance needs a fast tokenizer: vLLM's own choice
    ({"disable_any_whitespace": True}, False, True, {"backend": "xgrammar", "disable_any_whitespace": True}),
    ({}, True, False, None),  # vLLM's defaults (the benchmark's raw modes)
    ({"task": "embed"}, True, True, None),
])
def test_the_structured_output_backend_is_guidance_unless_the_job_or_the_tokenizer_says_otherwise(
        settings, fast_tokenizer, tuned, expected):
    from qbatch.plan import Machine, ModelFacts
    from qbatch.plan.engine_args import llm_kwargs
    from qbatch.spec import EngineSpec

    machine = Machine(ModelFacts("/m", fast_tokenizer=fast_tokenizer), platform="cuda", gpu_capability=8)
    kwargs, why = llm_kwargs(EngineSpec(**settings), 4096, machine, tuned=tuned)
    assert kwargs.get("structured_outputs_config") == expected
    if expected and not settings:
        assert why["structured_outputs_config"].startswith("qbatch's default: guidance")


def test_a_folder_without_tokenizer_json_is_not_taken_for_a_fast_tokenizer(tmp_path):
    from qbatch.plan.probing import _fast_tokenizer

    assert not _fast_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{}")
    assert _fast_tokenizer(str(tmp_path)) and _fast_tokenizer("Qwen/Qwen3-0.6B")


def test_thinking_token_budget_is_a_job_and_row_setting(write_jsonl, bundled_model):
    path = write_jsonl([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "x", "thinking_token_budget": 3}])
    requests = _requests(bundled_model, path, thinking_token_budget=10, reasoning_parser="qwen3")
    assert requests["a"].sampling["thinking_token_budget"] == 10 and requests["b"].sampling["thinking_token_budget"] == 3


def test_folders_from_before_row_seeds_resume_and_a_seed_is_a_change():
    """Manifests written before per-row seeds hold the engine's seed, 0 by default: no --seed still
    matches them; --seed 0 now seeds every row, so it must not."""
    from qbatch.spec import JobSpec

    unseeded = JobSpec.from_flat({}).result_settings()["seed"]
    seeded = JobSpec.from_flat({"seed": 0}).result_settings()["seed"]
    assert unseeded == 0 and seeded != unseeded
