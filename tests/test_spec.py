import pytest

from qbatch.errors import SpecError
from qbatch.spec import JobSpec, load_job_file, parse_shard


def test_defaults_are_not_vllms_footguns():
    spec = JobSpec.from_flat({})
    assert spec.sampling.max_tokens == 2048  # vLLM's default is 16
    assert spec.engine.model == "Qwen/Qwen3-0.6B"


def test_flat_keys_accept_dashes_and_route_to_sections():
    spec = JobSpec.from_flat({"max-tokens": 5, "chunk_tokens": 100, "model": "m", "dry_run": True})
    assert (spec.sampling.max_tokens, spec.plan.chunk_tokens, spec.engine.model, spec.output.dry_run) == (5, 100, "m", True)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"chunk_tokens": 0}, "chunk_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": "10"}, "max_tokens must be an integer >= 1, got '10'"),
        ({"shape": "csv"}, "shape must be one of auto, prompt, chat, openai; got 'csv'"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5"),
        ({"colour": 1}, "unknown setting 'colour'"),
        ({"shard": "3/2"}, "shard must satisfy 0 <= I < N, got '3/2'"),
    ],
)
def test_invalid_settings_state_the_rule(values, message):
    with pytest.raises(SpecError) as info:
        JobSpec.from_flat(values)
    assert info.value.message == message


def test_job_file_paths_are_relative_to_the_file(tmp_path):
    (tmp_path / "jobs").mkdir()
    job = tmp_path / "jobs" / "a.toml"
    job.write_text('inputs = ["../data/x.jsonl"]\noutput_dir = "../out"\nmax-tokens = 7\n')
    values = load_job_file(job)
    assert values["inputs"] == [str(tmp_path / "jobs" / "../data/x.jsonl")]
    assert values["max-tokens"] == 7


def test_bad_toml_names_the_file(tmp_path):
    job = tmp_path / "bad.toml"
    job.write_text("max_tokens = = 3")
    with pytest.raises(SpecError) as info:
        load_job_file(job)
    assert info.value.where == str(job)


def test_parse_shard():
    assert parse_shard("1/4") == (1, 4)


def _resolved(values: dict, engines_per_gpu: int = 1) -> JobSpec:
    spec = JobSpec.from_flat(values)
    spec.resolve_engines(engines_per_gpu)
    return spec


def test_default_chunk_budget_is_split_among_engines():
    """With N engines the default chunks are 16N times smaller, so the engines finish close together."""
    assert _resolved({}).plan.chunk_tokens == 4_194_304
    assert _resolved({"data_parallel_size": 2}).plan.chunk_tokens == 131_072
    assert _resolved({"gpus": ["0", "1", "2", "3"]}).plan.chunk_tokens == 65_536
    assert _resolved({}, engines_per_gpu=2).plan.chunk_tokens == 131_072
    assert _resolved({"data_parallel_size": 2}, engines_per_gpu=2).plan.chunk_tokens == 65_536
    assert _resolved({"data_parallel_size": 2, "chunk_tokens": 5000}).plan.chunk_tokens == 5000


def test_a_gpu_listed_twice_points_to_engines_per_gpu():
    with pytest.raises(SpecError, match="GPU 0 more than once") as info:
        JobSpec.from_flat({"gpus": ["0", "1", "0"]})
    assert "--engines-per-gpu 2" in info.value.hint


def test_engines_per_gpu_is_checked():
    with pytest.raises(SpecError, match="engines_per_gpu"):
        JobSpec.from_flat({"engines_per_gpu": 0})
    with pytest.raises(SpecError, match="Ray gives each engine its own GPU"):
        JobSpec.from_flat({"engines_per_gpu": 2, "backend": "ray"})
