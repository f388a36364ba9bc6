"""The plan complete and recorded: the environment vLLM's engines get is decided in plan/ (environment.py)
with the LLM(...) arguments, and the resolved plan goes into manifest.json, `qbatch status` and the report."""

from __future__ import annotations

import dataclasses
import json

from qbatch.plan import Machine, ModelFacts, resolve
from qbatch.plan.record import HIDDEN, plan_record
from qbatch.report.page import write_report
from qbatch.spec import JobSpec

QWEN = ModelFacts("/models/qwen3-0.6b", weights_bytes=1_200 << 20, max_model_len=40_960, reasoning_parser="qwen3")
H200X2 = Machine(QWEN, platform="cuda", gpu_name="NVIDIA H200", gpu_capability=9, gpu_memory_bytes=141 << 30,
                 gpu_count=2, cuda_visible_devices=("0", "1"), num_cores=32, compile_cache_root="/cache/vllm",
                 vllm_args=frozenset({"performance_mode"}), mps_control="/usr/bin/nvidia-cuda-mps-control")
CPU = Machine(QWEN, platform="cpu", num_cores=4, cpu_cores=(0, 1, 2, 3), cpu_has_bf16=False,
              compile_cache_root="/cache/vllm")


def spec(**settings) -> JobSpec:
    return JobSpec.from_flat({"model": "Qwen/Qwen3-0.6B", **settings})


def env(plan) -> dict[tuple[str, int | None], str | None]:
    return {(s.name, s.rank): s.value for s in plan.env}


def test_one_cpu_engine_gets_every_core_and_the_engine_applies_the_plans_environment():
    plan = resolve(spec(), CPU)
    assert env(plan) == {("VLLM_USE_FLASHINFER_SAMPLER", None): "0", ("VLLM_LOGGING_STREAM", None): None,
                         ("VLLM_CACHE_ROOT", None): "/cache/vllm", ("VLLM_CPU_OMP_THREADS_BIND", 0): "0-3",
                         ("VLLM_CPU_NUM_OF_RESERVED_CPU", 0): "0"}
    assert plan.engine.env_of(0) == {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_CACHE_ROOT": "/cache/vllm",
                                     "VLLM_CPU_OMP_THREADS_BIND": "0-3", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def test_cpu_engines_sharing_a_host_each_get_their_cores_and_a_users_binding_is_kept():
    plan = resolve(spec(data_parallel_size=2), CPU)
    assert plan.engine.env_of(1)["VLLM_CPU_OMP_THREADS_BIND"] == "1,3"
    assert plan.engine.env_of(0)["VLLM_CPU_OMP_THREADS_BIND"] == "0,2"
    users = dataclasses.replace(CPU, user_env={"VLLM_CPU_OMP_THREADS_BIND": "2-3"})
    kept = next(s for s in resolve(spec(), users).env if s.name == "VLLM_CPU_OMP_THREADS_BIND")
    assert (kept.value, kept.reason) == ("2-3", "set in the environment: kept")


def test_engines_sharing_gpus_each_see_their_gpu_and_the_mps_daemon():
    plan = resolve(spec(data_parallel_size=2), H200X2)
    assert plan.engine.engine_count() == 4 and plan.engine.mps
    assert [plan.engine.env_of(rank)["CUDA_VISIBLE_DEVICES"] for rank in range(4)] == ["0", "0", "1", "1"]
    assert env(plan)[("CUDA_MPS_PIPE_DIRECTORY", None)] is None  # known at the engines' start: named, set by mps.py
    assert "CUDA_MPS_PIPE_DIRECTORY" not in plan.engine.env_of(0)


def test_the_record_is_json_with_every_argument_and_variable_and_no_secret():
    machine = dataclasses.replace(H200X2, extra_args={"hf_token": "hf_secret", "max_num_seqs": 256})
    record = plan_record(resolve(spec(data_parallel_size=2), machine))
    assert json.loads(json.dumps(record)) == record
    assert record["llm_args"]["hf_token"]["value"] == HIDDEN and "hf_secret" not in json.dumps(record)
    assert record["llm_args"]["max_num_seqs"] == {"value": 256, "reason": "$QBATCH_VLLM_ARGS"}
    assert record["llm_args"]["gpu_memory_utilization"]["reason"] == "the GPU's share of 2 engines sharing it"
    assert record["placement"] == {"devices": ["0", "1"], "engines_per_gpu": 2, "data_parallel_size": 2,
                                   "engines": 4, "mps": True, "start_together": True}
    assert {"name": "CUDA_VISIBLE_DEVICES", "value": "1", "reason": "engine 3's GPU", "rank": 3} in record["env"]


def test_a_null_run_records_its_plan_and_status_and_the_report_show_it(cli, write_jsonl, bundled_model, tmp_path):
    out = tmp_path / "out"
    job = ["run", write_jsonl([{"id": f"r{i}", "prompt": f"p{i}"} for i in range(6)]), "-o", out, "--model",
           bundled_model, "--backend", "null", "--progress", "none"]
    assert cli(*job, "--limit", 3).exit_code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    recorded = manifest["plan"]
    assert recorded["backend"] == "null" and recorded["llm_args"]["max_model_len"]["reason"]
    assert recorded["decisions"]["chunk_tokens"]["reason"] == "the default for one engine"
    assert any(s["name"] == "VLLM_USE_FLASHINFER_SAMPLER" for s in recorded["env"])
    status = cli("status", out)
    assert "  engines         1 null engine(s) on cpu" in status.stdout.splitlines()
    full = cli("status", out, "--plan").stdout
    assert "  LLM max_model_len = " in full and "  env VLLM_USE_FLASHINFER_SAMPLER = 0  # flashinfer" in full
    assert json.loads(cli("status", out, "--json").stdout)["plan"] == recorded
    page = write_report(out).read_text()
    assert "<h2>Engine plan</h2>" in page and "LLM max_model_len = " in page

    # a folder of a run that recorded no plan resumes, and its next run records one
    (out / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "plan"}))
    assert "plan: not recorded" in cli("status", out, "--plan").stdout
    assert "not recorded (a run of a qbatch" in write_report(out).read_text()
    assert cli(*job).exit_code == 0
    assert json.loads((out / "manifest.json").read_text())["plan"] == recorded
