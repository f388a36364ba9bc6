"""--warm-up: the setting reaches each engine's configuration on a GPU (the flag, a Session, the plan), the
engine runs the batch inside its start when the configuration says so, and the batch is shaped like a real
decode batch.
The real engine's warm-up, outside the job's counters: tests/jobs/test_run_e2e.py."""

from __future__ import annotations

import dataclasses
import types

import pytest

from qbatch.engines import vllm as vllm_engine
from qbatch.engines.warm_up import max_output_tokens, warm_up_batch
from qbatch.plan import resolve
from qbatch.session import Session
from qbatch.spec import JobSpec
from tests.plan.test_resolve import CPU, H200


def _plan(machine, **settings):
    return resolve(JobSpec.from_flat({"model": "Qwen/Qwen3-0.6B", **settings}), machine)


def test_the_setting_reaches_the_engines_configuration_on_by_default_on_a_gpu():
    on = _plan(H200)
    assert on.engine.warm_up and on.decision("warm_up").value and "default on a GPU" in on.decision("warm_up").reason
    assert _plan(H200, warm_up=True).engine == on.engine
    off = _plan(H200, warm_up=False)
    assert not off.engine.warm_up and off.engine != on.engine  # an engine of its own: the pool's key
    assert "warm-up: on" in str(on) and "warm-up" not in str(off)  # --dry-run says so
    # only vLLM's generation engines on a GPU warm up (vllm-cpu has no CUDA graphs, kernels or MPS to warm)
    assert not _plan(CPU).engine.warm_up
    assert not _plan(H200, backend="null").engine.warm_up
    assert not _plan(H200, task="embed").engine.warm_up
    on_cpu = _plan(CPU, warm_up=True)
    assert not on_cpu.engine.warm_up and "on a GPU" in on_cpu.decision("warm_up").reason


def test_the_flag_and_a_session_set_it(cli, bundled_model, write_jsonl, monkeypatch):
    path = write_jsonl([{"prompt": "hi"}])
    result = cli("run", path, "--model", bundled_model, "--backend", "null", "--warm-up", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "no GPU: --warm-up ignored" in result.stderr  # this machine has none
    quiet = cli("run", path, "--model", bundled_model, "--backend", "null", "--no-warm-up", "--dry-run")
    assert quiet.exit_code == 0 and "warm-up" not in quiet.stderr, quiet.output
    monkeypatch.setattr("qbatch.jobs.runner.plan", lambda spec, pool: spec)
    assert Session(bundled_model, warm_up=True).plan(["hi"]).engine.warm_up


class FakeLLM:
    """What VllmEngine reads of vLLM's LLM at its start."""

    def __init__(self):
        scheduler = types.SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64)
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(scheduler_config=scheduler))


@pytest.mark.parametrize("on", [True, False])
def test_the_engine_warms_up_inside_its_start_when_its_configuration_says_so(monkeypatch, on):
    pytest.importorskip("vllm")
    warmed = []
    monkeypatch.setattr(vllm_engine, "start_llm", lambda model, path, kwargs: (FakeLLM(), vllm_engine.EngineLog(None)))
    monkeypatch.setattr(vllm_engine.FinalDecoder, "for_llm", classmethod(lambda cls, llm: None))
    monkeypatch.setattr(vllm_engine, "run_warm_up", lambda llm: warmed.append(llm) or 0.0)
    monkeypatch.setattr(vllm_engine, "scratch_folder", lambda: "")
    monkeypatch.setattr(vllm_engine, "load_tokenizer", lambda path, revision=None: None)  # no model folder here
    # the engine does as its configuration says; no environment for it (it would stay in this process's)
    config = dataclasses.replace(_plan(CPU).engine, warm_up=on, env=())
    engine = vllm_engine.VllmEngine(config)
    assert warmed == ([engine.llm] if on else [])
    assert engine.sample().finished_requests == 0 and engine.sample().prompt_tokens == 0


def test_the_batch_fills_the_engine_in_one_prefill_step_then_decodes_down_from_it():
    batch = warm_up_batch(max_num_seqs=1024, max_num_batched_tokens=16384, max_model_len=40960, vocab_size=151936)
    assert len(batch.prompts) == 1024  # the largest decode batch the engine runs (its largest CUDA graph)
    assert batch.num_prompt_tokens <= 16384  # one step's budget: every row decodes from the second step on
    assert len({len(p) for p in batch.prompts}) == 4  # several prompt lengths
    assert len({p[0] for p in batch.prompts}) == 1024  # no row shares a prefix with another
    # the prefill step gives each row its first token; then each decode step runs half the rows of the one
    # before, from every row down to one: the batch sizes of the engine's CUDA graphs, from its largest
    decode_steps = [sum(n > step for n in batch.max_tokens) for step in range(1, max(batch.max_tokens))]
    assert decode_steps == [1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1]
    assert max(batch.max_tokens) == max_output_tokens(1024) == 12  # a few output tokens


def test_the_batch_keeps_to_the_engines_limits():
    small = warm_up_batch(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=24, vocab_size=600)
    assert all(len(p) + n < 24 for p, n in zip(small.prompts, small.max_tokens, strict=True))  # vLLM's rule
    assert all(0 <= t < 600 for p in small.prompts for t in p)
    # a KV cache of 64 blocks of 16 tokens holds 64 rows of up to 16 tokens each (7 prompt + 10 output: 2 blocks)
    held = warm_up_batch(max_num_seqs=256, max_num_batched_tokens=1024, max_model_len=1024, vocab_size=50000,
                         kv_cache_tokens=128 * 16, block_size=16)
    assert len(held.prompts) == 64 and max(map(len, held.prompts)) + max_output_tokens(256) <= 32
    # more rows than one step's tokens: as many rows as tokens, one token each
    assert {len(p) for p in warm_up_batch(2048, 1024, 4096, 50000).prompts} == {1}
