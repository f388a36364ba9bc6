"""qbatch's engine defaults: the LLM(...) arguments a plan resolves (qbatch/plan/engine_args.py) on
hand-made machines: no vLLM import, no GPU, nothing patched."""

from __future__ import annotations

import dataclasses

import pytest

from qbatch.errors import SpecError
from qbatch.plan import Machine, ModelFacts
from qbatch.plan.engine_args import cuda_graph_sizes, llm_kwargs
from qbatch.plan.probing import EXTRA_ARGS_ENV, extra_engine_args
from qbatch.spec import EngineSpec

MODEL = ModelFacts("/m", weights_bytes=1 << 30, max_model_len=4096)
HOPPER = Machine(MODEL, platform="cuda", gpu_name="NVIDIA H200", gpu_capability=9, gpu_memory_bytes=141 << 30,
                 gpu_count=1, num_cores=16, vllm_args=frozenset({"performance_mode"}))
A100 = dataclasses.replace(HOPPER, gpu_name="NVIDIA A100-SXM4-80GB", gpu_capability=8)


def kwargs_of(spec: EngineSpec, machine: Machine = HOPPER, **options) -> dict:
    return llm_kwargs(spec, 4096, machine, **options)[0]


def test_hopper_skips_torch_compile_and_captures_full_cuda_graphs():
    kwargs = kwargs_of(EngineSpec())
    sizes = kwargs["compilation_config"].pop("cudagraph_capture_sizes")
    assert kwargs["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL"}
    assert kwargs["performance_mode"] == "throughput"
    vllms_own = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]  # vLLM's default sizes, up to 512
    assert sizes == vllms_own + [640, 768, 896, 1024, 1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048]


def test_cuda_graphs_cover_the_decode_steps_of_max_num_seqs():
    sizes = kwargs_of(EngineSpec(max_num_seqs=1000))["compilation_config"]["cudagraph_capture_sizes"]
    assert sizes[-4:] == [640, 768, 896, 1000]
    sizes = kwargs_of(EngineSpec(max_num_seqs=256))["compilation_config"]["cudagraph_capture_sizes"]
    assert sizes[-2:] == [496, 512]  # never fewer than vLLM's own


def test_other_gpus_enforce_eager_and_vllm_defaults_keep_vllms_compilation():
    assert "compilation_config" not in kwargs_of(EngineSpec(), A100)
    assert "compilation_config" not in kwargs_of(EngineSpec(enforce_eager=True))
    untuned = kwargs_of(EngineSpec(), tuned=False)
    assert "compilation_config" not in untuned and "performance_mode" not in untuned


def test_a_vllm_without_performance_mode_does_not_get_it():
    assert "performance_mode" not in kwargs_of(EngineSpec(), dataclasses.replace(HOPPER, vllm_args=frozenset()))


def test_extra_engine_args_come_last(monkeypatch):
    monkeypatch.setenv(EXTRA_ARGS_ENV, '{"compilation_config": {"mode": 3}, "max_num_seqs": 512}')
    machine = dataclasses.replace(HOPPER, extra_args=extra_engine_args())
    kwargs, why = llm_kwargs(EngineSpec(max_num_seqs=64), 4096, machine)
    assert kwargs["compilation_config"] == {"mode": 3} and kwargs["max_num_seqs"] == 512
    assert why["max_num_seqs"] == "$QBATCH_VLLM_ARGS"


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_extra_engine_args_must_be_a_json_object(monkeypatch, text):
    monkeypatch.setenv(EXTRA_ARGS_ENV, text)
    with pytest.raises(SpecError, match="QBATCH_VLLM_ARGS"):
        extra_engine_args()


def test_compilation_mode_sets_vllms_compilation_config():
    compiled = kwargs_of(EngineSpec(compilation_mode=3))["compilation_config"]
    # the uncompiled engine's full graphs for decode steps, none for prefill batches
    assert compiled.pop("cudagraph_capture_sizes") == cuda_graph_sizes(None)
    assert compiled == {"mode": 3, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert kwargs_of(EngineSpec(compilation_mode=3), tuned=False)["compilation_config"] == {"mode": 3}
    eager = EngineSpec(compilation_mode=3, enforce_eager=True)  # no graphs asked for: none chosen
    assert kwargs_of(eager)["compilation_config"] == {"mode": 3}
    assert kwargs_of(EngineSpec(compilation_mode=0))["compilation_config"]["cudagraph_mode"] == "FULL"
    assert kwargs_of(EngineSpec(compilation_mode=3), A100)["compilation_config"] == {"mode": 3}
    assert kwargs_of(EngineSpec(compilation_mode=0), A100)["compilation_config"] == {"mode": 0}
    assert "compilation_config" not in kwargs_of(EngineSpec(), A100)


def test_an_embedding_engine_on_hopper_neither_compiles_nor_captures():
    kwargs = kwargs_of(EngineSpec(task="embed"))
    assert kwargs["compilation_config"] == {"mode": 0, "cudagraph_mode": "NONE"} and kwargs["runner"] == "pooling"
    assert kwargs["convert"] == "embed"  # a decoder: vLLM converts it
    encoder = dataclasses.replace(HOPPER, model=dataclasses.replace(MODEL, decoder=False))
    assert "convert" not in kwargs_of(EngineSpec(task="embed"), encoder)


def test_vllm_cpu_starts_eager_with_a_fixed_kv_cache_and_float32_without_bf16():
    cpu = Machine(MODEL, platform="cpu", cpu_has_bf16=False)
    kwargs, why = llm_kwargs(EngineSpec(), 4096, cpu)
    assert (kwargs["enforce_eager"], kwargs["kv_cache_memory_bytes"], kwargs["dtype"]) == (True, 2 << 30, "float32")
    assert why["dtype"].startswith("vllm-cpu")
    assert kwargs_of(EngineSpec(quantization="awq"), cpu)["dtype"] == "auto"  # vLLM refuses float32 for AWQ
    assert kwargs_of(EngineSpec(), dataclasses.replace(cpu, cpu_has_bf16=True))["dtype"] == "auto"
    kept = kwargs_of(EngineSpec(enforce_eager=False, gpu_memory_utilization=0.5), cpu)
    assert kept["enforce_eager"] is False and "kv_cache_memory_bytes" not in kept


def test_an_uncompiled_qwen3_engine_on_a_gpu_runs_qbatchs_fused_class_of_the_model(monkeypatch):
    qwen3 = dataclasses.replace(HOPPER, model=dataclasses.replace(MODEL, architecture="Qwen3ForCausalLM"),
                                vllm_plugin=True)
    kwargs, why = llm_kwargs(EngineSpec(), 4096, qwen3)
    assert kwargs["hf_overrides"] == {"architectures": ["QbatchQwen3ForCausalLM"]}
    assert "one vLLM kernel" in why["hf_overrides"]
    assert kwargs_of(EngineSpec(enforce_eager=True), qwen3)["hf_overrides"]  # eager: uncompiled too
    # compiled (torch.compile fuses them itself), vLLM's defaults, another model, the CPU, no plugin
    assert "hf_overrides" not in kwargs_of(EngineSpec(compilation_mode=3), qwen3)
    assert "hf_overrides" not in kwargs_of(EngineSpec(), dataclasses.replace(qwen3, gpu_capability=8))
    assert "hf_overrides" not in kwargs_of(EngineSpec(), qwen3, tuned=False)
    assert "hf_overrides" not in kwargs_of(EngineSpec(), HOPPER)
    assert "hf_overrides" not in kwargs_of(EngineSpec(), dataclasses.replace(qwen3, platform="cpu"))
    assert kwargs_of(EngineSpec(task="embed"), qwen3)["hf_overrides"]  # vLLM converts the class to embed
    assert "hf_overrides" not in kwargs_of(EngineSpec(), dataclasses.replace(qwen3, vllm_plugin=False))
    monkeypatch.setenv(EXTRA_ARGS_ENV, '{"hf_overrides": {}}')  # vLLM's own class, as a user may ask
    assert kwargs_of(EngineSpec(), dataclasses.replace(qwen3, extra_args=extra_engine_args()))["hf_overrides"] == {}
