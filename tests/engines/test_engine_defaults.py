"""qbatch's engine defaults (engine_kwargs), with the platform faked: no vLLM import, no GPU."""

from __future__ import annotations

import pytest

from qbatch.engines import vllm as engine
from qbatch.errors import SpecError
from qbatch.spec import EngineSpec


@pytest.fixture
def platform(monkeypatch):
    """platform(hopper=True): engine_kwargs as on an H100/H200 with vLLM that knows performance_mode."""

    def set_platform(*, hopper: bool) -> None:
        monkeypatch.setattr(engine, "on_cpu", lambda: False)
        monkeypatch.setattr(engine, "on_hopper", lambda: hopper)
        monkeypatch.setattr(engine, "engine_arg_names", lambda: {"performance_mode"})
        monkeypatch.delenv(engine.EXTRA_ARGS_ENV, raising=False)

    return set_platform


def test_hopper_skips_torch_compile_and_captures_full_cuda_graphs(platform):
    platform(hopper=True)
    kwargs = engine.engine_kwargs(EngineSpec(), 4096)
    sizes = kwargs["compilation_config"].pop("cudagraph_capture_sizes")
    assert kwargs["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL"}
    assert kwargs["performance_mode"] == "throughput"
    vllms_own = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]  # vLLM's default sizes, up to 512
    assert sizes == vllms_own + [640, 768, 896, 1024, 1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048]


def test_cuda_graphs_cover_the_decode_steps_of_max_num_seqs(platform):
    platform(hopper=True)
    sizes = engine.engine_kwargs(EngineSpec(max_num_seqs=1000), 4096)["compilation_config"]["cudagraph_capture_sizes"]
    assert sizes[-4:] == [640, 768, 896, 1000]
    sizes = engine.engine_kwargs(EngineSpec(max_num_seqs=256), 4096)["compilation_config"]["cudagraph_capture_sizes"]
    assert sizes[-2:] == [496, 512]  # never fewer than vLLM's own


def test_other_gpus_enforce_eager_and_vllm_defaults_keep_vllms_compilation(platform):
    platform(hopper=False)
    assert "compilation_config" not in engine.engine_kwargs(EngineSpec(), 4096)
    platform(hopper=True)
    assert "compilation_config" not in engine.engine_kwargs(EngineSpec(enforce_eager=True), 4096)
    untuned = engine.engine_kwargs(EngineSpec(), 4096, tuned=False)
    assert "compilation_config" not in untuned and "performance_mode" not in untuned


def test_extra_engine_args_come_last(platform, monkeypatch):
    platform(hopper=True)
    monkeypatch.setenv(engine.EXTRA_ARGS_ENV, '{"compilation_config": {"mode": 3}, "max_num_seqs": 512}')
    kwargs = engine.engine_kwargs(EngineSpec(max_num_seqs=64), 4096)
    assert kwargs["compilation_config"] == {"mode": 3} and kwargs["max_num_seqs"] == 512


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_extra_engine_args_must_be_a_json_object(platform, monkeypatch, text):
    platform(hopper=False)
    monkeypatch.setenv(engine.EXTRA_ARGS_ENV, text)
    with pytest.raises(SpecError, match="QBATCH_VLLM_ARGS"):
        engine.engine_kwargs(EngineSpec(), 4096)


def test_compilation_mode_sets_vllms_compilation_config(platform):
    platform(hopper=True)
    compiled = engine.engine_kwargs(EngineSpec(compilation_mode=3), 4096)["compilation_config"]
    # the uncompiled engine's full graphs for decode steps, none for prefill batches
    assert compiled.pop("cudagraph_capture_sizes") == engine.cuda_graph_sizes(None)
    assert compiled == {"mode": 3, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert engine.engine_kwargs(EngineSpec(compilation_mode=3), 4096, tuned=False)["compilation_config"] == {"mode": 3}
    eager = EngineSpec(compilation_mode=3, enforce_eager=True)  # no graphs asked for: none chosen
    assert engine.engine_kwargs(eager, 4096)["compilation_config"] == {"mode": 3}
    assert engine.engine_kwargs(EngineSpec(compilation_mode=0), 4096)["compilation_config"]["cudagraph_mode"] == "FULL"
    platform(hopper=False)
    assert engine.engine_kwargs(EngineSpec(compilation_mode=3), 4096)["compilation_config"] == {"mode": 3}
    assert engine.engine_kwargs(EngineSpec(compilation_mode=0), 4096)["compilation_config"] == {"mode": 0}
    assert "compilation_config" not in engine.engine_kwargs(EngineSpec(), 4096)


def test_an_embedding_engine_on_hopper_neither_compiles_nor_captures(platform):
    platform(hopper=True)
    kwargs = engine.engine_kwargs(EngineSpec(task="embed"), 4096)
    assert kwargs["compilation_config"] == {"mode": 0, "cudagraph_mode": "NONE"} and kwargs["runner"] == "pooling"
