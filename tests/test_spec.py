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
        ({"max_tokens": "10"}, 'max_tokens must be an integer, got "10"'),
        ({"shape": "csv"}, "shape must be one of auto, prompt, chat, openai; got 'csv'"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5"),
        ({"flavour": 1}, "unknown setting 'flavour'"),  # no setting is close to it (colour: lora)
        ({"shard": "3/2"}, "shard must satisfy 0 <= I < N, got '3/2'"),
        # the choices and ranges declared with each setting (spec.py), checked for every door
        ({"backend": "gpu"}, "backend must be one of vllm, ray, null; got 'gpu'"),
        ({"embedding_dtype": "int8"}, "embedding_dtype must be one of float32, float16; got 'int8'"),
        ({"quantize": "gptq"}, "quantize must be 'awq', got 'gptq'"),
        ({"compilation_mode": 4}, "compilation_mode must be 0, 1, 2 or 3 (vLLM's CompilationMode), got 4"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be in (0, 1], got 0.0"),  # 0 is out
        ({"max_unusable": 1.5}, "max_unusable must be a share of the rows in [0, 1], got 1.5"),
        ({"price_per_gpu_hour": -1}, "price_per_gpu_hour must be >= 0, got -1.0"),
        ({"max_cpu_loras": 0}, "max_cpu_loras must be an integer >= 1, got 0"),
        ({"dimensions": 0}, "dimensions must be an integer >= 1, got 0"),
        ({"format": 3}, "format must be a string, got 3"),
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
    assert values["inputs"] == [str(tmp_path / "data" / "x.jsonl")] and values["output_dir"] == str(tmp_path / "out")
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
    from qbatch.plan import Machine, ModelFacts, resolve

    # a GPU machine: without a GPU, --engines-per-gpu runs one engine (plan/placement.py)
    machine = Machine(ModelFacts("/m", weights_bytes=1 << 28, max_model_len=4096), platform="cuda",
                      gpu_name="NVIDIA H200", gpu_capability=9, gpu_memory_bytes=141 << 30, gpu_count=4)
    return resolve(JobSpec.from_flat({**values, "engines_per_gpu": engines_per_gpu}), machine).spec


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


# Job-level sampling values follow the per-row rules (validate.py), checked before any model loads.
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"temperature": -1.0}, "temperature must be in [0, 2], got -1.0"),
        ({"temperature": 2.5}, "temperature must be in [0, 2], got 2.5"),
        ({"temperature": float("inf")}, "temperature must be in [0, 2], got inf"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_k": -2}, "top_k must be >= -1 (0 or -1: off), got -2"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2], got 3.0"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0, got 0.0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number > 0, got inf"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"stop": ["end", ""]}, "stop must be a string or a list of strings, got ['end', '']"),
    ],
)
def test_job_sampling_values_follow_the_row_rules(values, message):
    with pytest.raises(SpecError) as info:
        JobSpec.from_flat(values, source="jobs/x.toml")
    assert info.value.message == message


def test_sampling_rules_refuse_what_vllm_refuses():
    """Every value qbatch's rules let through, vLLM's SamplingParams accepts; every one they refuse, it refuses."""
    sampling_params = pytest.importorskip("vllm.sampling_params")
    from vllm.exceptions import VLLMError

    from qbatch.errors import RowError
    from qbatch.sampling import check_params

    cases = [{"temperature": t} for t in (-0.1, 0.0, 2.0, 2.1, float("nan"), float("inf"))]
    cases += [{"top_p": p} for p in (0.0, 1e-3, 1.0, 1.1)] + [{"top_k": k} for k in (-2, -1, 0, 1)]
    cases += [{"min_p": p} for p in (-0.1, 0.0, 1.0, 1.1)] + [{"max_tokens": n} for n in (0, 1)]
    cases += [{name: v} for name in ("presence_penalty", "frequency_penalty") for v in (-2.1, -2.0, 2.0, 2.1)]
    cases += [{"repetition_penalty": v} for v in (0.0, 0.5, float("inf"))]
    cases += [{"min_tokens": 5, "max_tokens": 4}, {"min_tokens": 4, "max_tokens": 4}, {"stop": ["a", ""]}]
    for params in cases:
        try:
            check_params(params)
            ours = True
        except RowError:
            ours = False
        try:
            sampling_params.SamplingParams(**params)
            theirs = True
        except (ValueError, VLLMError):
            theirs = False
        assert ours == theirs, params


def test_logit_bias_reaches_vllm_as_token_ids():
    """OpenAI's logit_bias has text keys (JSON); vLLM's SamplingParams, built directly, takes token ids."""
    sampling_params = pytest.importorskip("vllm.sampling_params")
    from qbatch.sampling import check_params, to_vllm

    params = to_vllm(check_params({"logit_bias": {"15": 100, "16": -5.5}}))
    assert sampling_params.SamplingParams(**params).logit_bias == {15: 100.0, 16: -5.5}


# Every job-file (and from_flat) value has its field's type.
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"raw": "false"}, 'raw must be true or false, got "false"'),
        ({"keep_columns": "a,b"}, 'keep_columns must be a list of strings, got "a,b"'),
        ({"temperature": "hot"}, 'temperature must be a number, got "hot"'),
        ({"max_tokens": "10"}, 'max_tokens must be an integer, got "10"'),
        ({"max_tokens": 1.5}, "max_tokens must be an integer, got 1.5"),
        ({"dedupe": 1}, "dedupe must be true or false, got 1"),
        ({"model": 3}, "model must be a string, got 3"),
        ({"inputs": ["a.jsonl", 2]}, 'inputs must be a list of strings, got ["a.jsonl", 2]'),
        ({"thinking": "no"}, 'thinking must be true or false, got "no"'),
        ({"max_token": 5}, "unknown setting 'max_token' (did you mean max_tokens?)"),
        ({"flavour": 1}, "unknown setting 'flavour'"),  # no setting is close to it (colour: lora)
    ],
)
def test_wrong_types_name_the_key_the_type_and_the_value(values, message):
    with pytest.raises(SpecError) as info:
        JobSpec.from_flat(values, source="jobs/x.toml")
    assert info.value.message == message
    assert str(info.value) == f"{message} (jobs/x.toml)"


def test_one_string_is_a_one_item_list_where_a_list_is_meant(tmp_path):
    spec = JobSpec.from_flat({"inputs": "p.jsonl", "stop": "END", "gpus": [0, 1], "temperature": 1})
    assert (spec.input.inputs, spec.sampling.stop, spec.engine.gpus) == (["p.jsonl"], ["END"], ["0", "1"])
    assert spec.sampling.temperature == 1.0 and isinstance(spec.sampling.temperature, float)


def test_job_file_types_are_checked(tmp_path, cli):
    job = tmp_path / "x.toml"
    job.write_text('inputs = "p.jsonl"\nraw = "false"\n')
    result = cli("run", "--job", job, "--dry-run")
    assert result.exit_code == 2
    assert result.output.startswith(f'Error: raw must be true or false, got "false" ({job})')
    job.write_text('inputs = "p.jsonl"\nmax_token = 3\n')
    assert "did you mean max_tokens?" in cli("run", "--job", job, "--dry-run").output


def test_bad_job_sampling_value_stops_a_dry_run(tmp_path, cli, write_jsonl):
    path = write_jsonl([{"prompt": "hi"}])
    result = cli("run", path, "-o", tmp_path / "out", "--model", "smollm2-135m", "--dry-run", "--temperature", "-1")
    assert result.exit_code == 2
    assert "Error: temperature must be in [0, 2], got -1.0\nHint: set --temperature (job file: temperature)" in result.output


def test_every_path_of_a_job_file_is_relative_to_the_file(tmp_path):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "schema.json").write_text('{"type": "object"}')
    job = tmp_path / "jobs" / "a.toml"
    job.write_text('json-schema = "schema.json"\ngrammar = "../g.gbnf"\ntokenizer = "./tok"\nmodel = "./m"\n')
    values = load_job_file(job)
    assert values["json-schema"] == str(tmp_path / "jobs" / "schema.json")
    assert values["grammar"] == str(tmp_path / "g.gbnf")  # missing: the error names where it was looked for
    assert values["tokenizer"] == str(tmp_path / "jobs" / "tok") and values["model"] == str(tmp_path / "jobs" / "m")
    job.write_text('json_schema = \'{"type": "object"}\'\nmodel = "Qwen/Qwen3-0.6B"\n')  # text, a hub name: as given
    assert load_job_file(job) == {"json_schema": '{"type": "object"}', "model": "Qwen/Qwen3-0.6B"}


def test_a_job_file_run_from_another_folder_finds_its_schema(cli, bundled_model, tmp_path, monkeypatch):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "schema.json").write_text('{"type": "object", "properties": {"a": {"type": "string"}}}')
    (tmp_path / "jobs" / "in.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    (tmp_path / "jobs" / "a.toml").write_text('inputs = ["in.jsonl"]\njson_schema = "schema.json"\n')
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = cli("run", "--job", tmp_path / "jobs" / "a.toml", "--dry-run", "--model", bundled_model,
                 "--backend", "null", "--max-model-len", "2048")
    assert result.exit_code == 0, result.output
