"""Engines per GPU and torch.compile from the job's shape (plan/placement.choose_engines, plan/shape.py,
jobs/shape.py samples): a GPU machine built by hand, no engine started."""

from __future__ import annotations

import dataclasses
import json

import pytest

from qbatch.engines import compile_cache
from qbatch.engines.pool import EnginePool
from qbatch.jobs import shape
from qbatch.jobs.job import Job
from qbatch.plan import placement, probing
from qbatch.plan.placement import COMPILE_REPAID_TOKENS, TORCH_COMPILE, WARM_COMPILE_REPAID_TOKENS, choose_engines
from qbatch.spec import JobSpec


@pytest.mark.parametrize(("prompt", "output", "warm", "expected"), [
    (WARM_COMPILE_REPAID_TOKENS, 8_000, True, (2, TORCH_COMPILE)),  # prefill-bound, compiled before: both engines
    (1_000_000, 8_000, True, (2, None)),  # prefill-bound, too short even for a cached compile
    (WARM_COMPILE_REPAID_TOKENS, 8_000, False, (2, None)),  # a first compile would not pay
    (COMPILE_REPAID_TOKENS, 8_000, False, (1, TORCH_COMPILE)),  # long enough to repay it: one engine compiles
    (COMPILE_REPAID_TOKENS, COMPILE_REPAID_TOKENS, True, (2, None)),  # decode-bound: the defaults
])
def test_choose_engines(prompt, output, warm, expected):
    choice = choose_engines(prompt, output, 1000, gpu=True, compile_cache_warm=warm, default_engines=2)
    assert (choice.engines_per_gpu, choice.compilation_mode) == expected
    assert choice.reason.startswith(f"1000 rows, {prompt} prompt + {output} output tokens")


def test_no_gpu_keeps_the_defaults():
    choice = choose_engines(1_000_000, 8, 10, gpu=False, compile_cache_warm=True, default_engines=1)
    assert (choice.engines_per_gpu, choice.compilation_mode) == (1, None)


GPU = {"platform": "cuda", "gpu_name": "NVIDIA H200", "gpu_capability": 9, "gpu_memory_bytes": 141 << 30,
       "gpu_count": 1, "num_cores": 16}


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """An H200's memory as nvidia-smi would report it, 16 cores (job_for's machine), an empty compile cache."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    monkeypatch.delenv(probing.EXTRA_ARGS_ENV, raising=False)
    return GPU


def job_for(bundled_model, tmp_path, rows, machine=GPU, **settings) -> Job:
    """The job of these rows and settings on this machine (the probed one, with `machine`'s facts)."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, **settings})
    return Job.setup(spec, dataclasses.replace(probing.probe(spec, bundled_model), **machine))


def warmed(job: Job) -> Job:
    """The job on its machine once an engine of its settings with torch.compile has compiled there."""
    compile_cache.note_compiled(compile_cache.marker_settings(job.spec.engine.one_engine(compilation_mode=TORCH_COMPILE),
                                                              job.model_path, job.max_model_len,
                                                              compile_cache.vllm_version()))
    machine = dataclasses.replace(job.plan.machine, warm_compiles=compile_cache.warm_markers())
    return Job.setup(job.plan.requested, machine)


DOCS = [{"id": str(i), "prompt": "Read this and answer. " + "lorem ipsum dolor " * 200} for i in range(40)]


def test_prefill_bound_job_with_a_warm_compile_gets_its_engines_compiled(gpu, bundled_model, tmp_path, monkeypatch):
    monkeypatch.setattr(placement, "WARM_COMPILE_REPAID_TOKENS", 10_000)  # 40 rows of ~600 tokens repay it
    job = job_for(bundled_model, tmp_path, DOCS, max_tokens=8)
    assert job.spec.engine.engines_per_gpu == 2  # the default for a small model on a big GPU
    job = warmed(job)
    chosen = shape.choose_for_shape(job, set(), EnginePool())
    choice = chosen.plan.choice
    assert (chosen.spec.engine.engines_per_gpu, chosen.spec.engine.compilation_mode) == (2, TORCH_COMPILE)
    assert chosen.spec.engine.kv_cache_memory_bytes == job.spec.engine.kv_cache_memory_bytes  # still start together
    assert "prefill-bound, compiled before on this machine" in choice.reason and choice.reason.startswith("40 rows")
    assert job.spec.engine.compilation_mode is None  # the job given is left as it is


def test_a_first_compile_runs_on_one_engine(gpu, bundled_model, tmp_path, monkeypatch):
    """With an empty compile cache one engine compiles (two would write the same cache files at once)."""
    monkeypatch.setattr(placement, "COMPILE_REPAID_TOKENS", 10_000)
    job = job_for(bundled_model, tmp_path, DOCS, max_tokens=8)
    chosen = shape.choose_for_shape(job, set(), EnginePool())
    choice = chosen.plan.choice
    assert (chosen.spec.engine.engines_per_gpu, chosen.spec.engine.compilation_mode) == (1, TORCH_COMPILE)
    assert chosen.spec.plan.chunk_tokens == 4_194_304  # one engine: the chunk size of one
    assert "long enough to repay a first torch.compile" in choice.reason


def test_cold_compile_and_decode_bound_jobs_keep_the_defaults(gpu, bundled_model, tmp_path, monkeypatch):
    monkeypatch.setattr(placement, "WARM_COMPILE_REPAID_TOKENS", 10_000)
    job = job_for(bundled_model, tmp_path, DOCS, max_tokens=8)
    chosen = shape.choose_for_shape(job, set(), EnginePool())
    assert chosen.spec == job.spec and "too short to repay a first torch.compile" in chosen.plan.choice.reason
    job = job_for(bundled_model, tmp_path, DOCS, max_tokens=2048)
    chosen = shape.choose_for_shape(job, set(), EnginePool())
    assert chosen.spec == job.spec and "decode-bound" in chosen.plan.choice.reason


@pytest.mark.parametrize("settings", [{"engines_per_gpu": 2}, {"compilation_mode": 0}, {"enforce_eager": False},
                                      {"backend": "null"}])
def test_an_explicit_setting_always_wins(gpu, bundled_model, tmp_path, settings):
    job = warmed(job_for(bundled_model, tmp_path, DOCS, max_tokens=8, **settings))
    assert shape.choose_for_shape(job, set(), EnginePool()) is job


def test_a_compilation_config_in_qbatch_vllm_args_wins(gpu, bundled_model, tmp_path, monkeypatch):
    monkeypatch.setenv(probing.EXTRA_ARGS_ENV, '{"compilation_config": {"mode": 0}}')
    job = job_for(bundled_model, tmp_path, DOCS, max_tokens=8)
    assert shape.choose_for_shape(job, set(), EnginePool()) is job


def test_no_choice_without_a_gpu(bundled_model, tmp_path):
    job = job_for(bundled_model, tmp_path, DOCS, {**GPU, "platform": "cpu", "gpu_memory_bytes": None}, max_tokens=8)
    assert shape.choose_for_shape(job, set(), EnginePool()) is job


def test_an_engine_of_the_pool_that_fits_the_job_is_chosen_before_sampling(gpu, bundled_model, tmp_path):
    """A Session's warm compiled engine serves a job its shape would give the defaults: no start at all."""
    job = job_for(bundled_model, tmp_path, DOCS, max_tokens=2048)
    compiled = shape.candidates(job.plan)[1]
    pool = EnginePool(start=lambda config, wait=True: type("Fake", (), {"close": lambda self: None})())
    pool.get(compiled.engine)
    chosen = shape.choose_for_shape(job, set(), pool)
    assert chosen.plan.engine == compiled.engine and chosen.spec.engine.compilation_mode == TORCH_COMPILE
    assert chosen.plan.choice is None


def test_engines_kept_for_later_runs_start_compiled_where_they_compiled_before(gpu, bundled_model, tmp_path):
    """A Session's or a service's engines serve many jobs: with a warm compile cache they start compiled
    whatever the first job's shape (decode-bound, short); a command's own pool keeps the job's choice, and
    a cold cache leaves the choice to the shape."""
    job = job_for(bundled_model, tmp_path, DOCS, max_tokens=2048)  # decode-bound and short
    assert shape.choose_for_shape(job, set(), EnginePool(kept=True)).spec.engine.compilation_mode is None  # cold
    job = warmed(job)
    chosen = shape.choose_for_shape(job, set(), EnginePool(kept=True))
    assert (chosen.spec.engine.engines_per_gpu, chosen.spec.engine.compilation_mode) == (2, TORCH_COMPILE)
    assert chosen.plan.choice.reason.startswith("kept for later runs and compiled before on this machine")
    assert chosen.plan.engine == shape.candidates(job.plan)[1].engine  # the next job finds them in the pool
    assert shape.choose_for_shape(job, set(), EnginePool()).spec.engine.compilation_mode is None
    explicit = warmed(job_for(bundled_model, tmp_path, DOCS, max_tokens=2048, compilation_mode=0))
    assert shape.choose_for_shape(explicit, set(), EnginePool(kept=True)) is explicit


def test_the_doors_that_keep_engines_say_so(tmp_path, monkeypatch):
    """A Session's and a service's pools keep their engines for later runs; qbatch.run's one job's does not."""
    from qbatch.serve.config import ServeSettings
    from qbatch.serve.server import Service
    from qbatch.session import session

    assert session.Session("m").pool.kept
    service = Service(ServeSettings(data_dir=tmp_path / "serve", engine={"model": "m"}))
    assert service.pool.kept
    service.store.close()
    monkeypatch.setattr(session.Session, "run", lambda self, data, **settings: self.pool.kept)
    assert session.run(["hi"], model="m") is False


def test_rows_estimated_from_a_sample_and_the_file_size(gpu, bundled_model, tmp_path, monkeypatch):
    monkeypatch.setattr(shape, "SAMPLE_ROWS", 10)
    rows = [{"id": str(i), "prompt": "lorem ipsum " * 20} for i in range(1000)]
    job = job_for(bundled_model, tmp_path, rows, max_tokens=8)
    found = shape.sample_shape(job, set())
    assert found.estimated and 900 <= found.rows <= 1100
    assert found.output_tokens == 8 * found.rows
    assert shape.sample_shape(job_for(bundled_model, tmp_path, rows, max_tokens=8, limit=500), set()).rows == 500


def test_engines_sharing_a_gpu_get_a_fixed_kv_cache_so_they_start_together(gpu, bundled_model, tmp_path, monkeypatch):
    job = job_for(bundled_model, tmp_path, DOCS, max_tokens=8)
    expected = int((141 << 30) * placement.VLLM_DEFAULT_UTILIZATION / 2 * (1 - placement.NON_KV_SHARE)) \
        - job.weights_bytes
    assert job.spec.engine.engines_per_gpu == 2 and job.spec.engine.kv_cache_memory_bytes == expected
    # one compiled engine for a prefill-bound job's first compile: vLLM sizes its KV cache again (the whole GPU's)
    monkeypatch.setattr(placement, "COMPILE_REPAID_TOKENS", 10_000)
    chosen = shape.choose_for_shape(job, set(), EnginePool())
    assert chosen.spec.engine.engines_per_gpu == 1 and chosen.spec.engine.kv_cache_memory_bytes is None


@pytest.mark.parametrize(("settings", "kv_bytes"), [
    ({"gpu_memory_utilization": 0.8}, None),  # the user's share of the GPU: vLLM profiles within it
    ({"kv_cache_memory_bytes": 1 << 30}, 1 << 30),  # the user's size, kept
    ({"engines_per_gpu": 1}, None),  # an engine alone on its GPU starts at once anyway
])
def test_the_users_memory_settings_win(gpu, bundled_model, tmp_path, settings, kv_bytes):
    assert job_for(bundled_model, tmp_path, DOCS, **settings).spec.engine.kv_cache_memory_bytes == kv_bytes


def test_no_fixed_kv_cache_without_a_gpu(bundled_model, tmp_path):
    no_gpu = {**GPU, "platform": "unknown", "gpu_memory_bytes": None}
    assert job_for(bundled_model, tmp_path, DOCS, no_gpu, engines_per_gpu=2).spec.engine.kv_cache_memory_bytes is None


def test_a_small_jsonl_job_starts_its_engines_without_the_tokenizer(gpu, bundled_model, tmp_path, monkeypatch):
    """A few MB of JSONL cannot hold the tokens that repay torch.compile: the default engines are chosen from
    the inputs' size, before the tokenizer loads (a cold `qbatch run` starts its engines seconds earlier)."""
    job = job_for(bundled_model, tmp_path, DOCS, max_tokens=8)
    monkeypatch.setattr(shape, "sample_shape", lambda *a: pytest.fail("sampled a job its size already decides"))
    chosen = shape.choose_for_shape(job, set(), EnginePool())
    assert chosen.spec == job.spec and not chosen.loaded  # the defaults, no tokenizer loaded
    bound = shape.max_prompt_tokens(job)
    assert chosen.plan.choice.reason == (f"at most {bound:,} prompt tokens (the inputs' size): too short to repay "
                                         "torch.compile, the defaults")
    # where the size could hold enough tokens, the job is sampled as before
    monkeypatch.setattr(placement, "WARM_COMPILE_REPAID_TOKENS", bound // 2)
    monkeypatch.setattr(shape, "sample_shape", lambda *a: shape.JobShape(40, 1000, 8, estimated=False))
    assert "too short to repay a first torch.compile" in shape.choose_for_shape(job, set(), EnginePool()).plan.choice.reason


def test_the_size_bound_holds_the_real_prompt_tokens_and_says_nothing_of_other_inputs(gpu, bundled_model, tmp_path):
    """max_prompt_tokens is a bound: never under the tokens the run counts (chat template, system prompt and
    all), for prompts and for messages; Parquet and compressed inputs have none."""
    import gzip

    import polars as pl

    rows = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "é" * 50},
            {"id": "c", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                     {"role": "user", "content": "and?"}]}]
    for settings in ({}, {"system_prompt": "Answer briefly. " * 20}, {"task": "embed", "instruction": "Find it " * 30}):
        job = job_for(bundled_model, tmp_path, rows, **settings)
        sampled = shape.sample_shape(job, set())
        assert sampled.rows == 3 and shape.max_prompt_tokens(job) >= sampled.prompt_tokens
    parquet = tmp_path / "in.parquet"
    pl.DataFrame({"id": ["a"], "prompt": ["x"]}).write_parquet(parquet)
    packed = tmp_path / "in.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"id": "a", "prompt": "x"}\n'))
    for path, settings in ((parquet, {}), (packed, {}), (tmp_path / "in.jsonl", {"template": "{prompt} {prompt}"})):
        spec = JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, **settings})
        machine = dataclasses.replace(probing.probe(spec, bundled_model), **GPU)
        assert shape.max_prompt_tokens(Job.setup(spec, machine)) is None
