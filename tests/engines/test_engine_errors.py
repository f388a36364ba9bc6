"""An engine that cannot start: too little memory is told from a missing model, each with its own hint."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle

import pytest

from qbatch.engines.start_errors import (
    MEMORY_HINT,
    MISSING_HINT,
    UNKNOWN_HINT,
    start_error,
    start_log,
)
from qbatch.errors import EXIT_ENGINE, EngineError, ModelError

CORE_FAILED = RuntimeError("Engine core initialization failed. See root cause above. "
                           "Failed core proc(s): {'EngineCore': 1}")
# vLLM's texts, as its source writes them (v1/worker/utils.py, v1/worker/cpu_worker.py)
GPU_NOT_FREE = ("Free memory on device cuda:0 (10.5/139.8 GiB) on startup is less than desired GPU memory "
                "utilization (0.9, 125.8 GiB). Decrease GPU memory utilization or reduce GPU memory used by "
                "other processes.")
CPU_NOT_FREE = ("Available memory on node 0 (3.1/7.8 GiB) on startup is less than desired CPU memory utilization "
                "(0.92, 7.2 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls the fraction "
                "of CPU memory reserved (despite its name).")


def _kv_cache_errors() -> list[ValueError]:
    """The KV cache checks' own errors, raised by vLLM's own function."""
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    errors = []
    for available, needed in ((0, 1), (1 << 20, 1 << 30)):
        try:
            kv_cache_utils._check_enough_kv_cache_memory(available, lambda n=needed: n, 4096, lambda _: 64)
        except ValueError as exc:
            errors.append(exc)
    assert len(errors) == 2
    return errors


def test_memory_errors_get_the_memory_hint():
    torch = pytest.importorskip("torch")
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB")
    for exc in [*_kv_cache_errors(), ValueError(GPU_NOT_FREE), ValueError(CPU_NOT_FREE), oom, MemoryError()]:
        error = start_error("m", exc)
        assert isinstance(error, EngineError) and error.exit_code == EXIT_ENGINE, exc
        assert error.message.startswith("not enough memory to start the engine for model 'm': ")
        assert error.hint == MEMORY_HINT
        for flag in ("--gpu-memory-utilization", "--kv-cache-memory-bytes", "--max-model-len", "--max-num-seqs"):
            assert flag in error.hint


def test_the_engine_cores_logged_cause_decides_when_llm_says_only_that_it_failed():
    no_cache = _kv_cache_errors()[0]
    logged = ("EngineCore failed to start.\nTraceback (most recent call last):\n"
              '  File "kv_cache_utils.py", line 1010, in _check_enough_kv_cache_memory\n    raise ValueError(\n'
              f"ValueError: {no_cache}\n")
    error = start_error("m", CORE_FAILED, logged)
    assert isinstance(error, EngineError)
    assert error.message == "not enough memory to start the engine for model 'm': " + f"ValueError: {no_cache}"[:500]


def test_a_missing_model_keeps_the_model_hint():
    exc = OSError("Qwen/Qwen9 is not a local folder and is not a valid model identifier listed on "
                  "'https://huggingface.co/models'")
    error = start_error("Qwen/Qwen9", exc)
    assert isinstance(error, ModelError) and error.hint == MISSING_HINT
    assert error.message == f"vLLM could not load model 'Qwen/Qwen9': {exc}"


def test_an_unknown_cause_claims_neither():
    error = start_error("m", CORE_FAILED, "")
    assert isinstance(error, ModelError) and error.hint == UNKNOWN_HINT
    assert error.message.startswith("vLLM could not start model 'm': Engine core initialization failed.")


def _log_error(text: str) -> None:
    logging.getLogger("vllm.v1.engine.core").error(text)


def test_start_log_hears_a_forked_process_and_leaves_no_file_behind(tmp_path):
    context = mp.get_context("fork")
    with start_log() as logged:
        child = context.Process(target=_log_error, args=("ValueError: No available memory for the cache blocks.",))
        child.start()
        child.join()
        path = next(h.path for h in logging.getLogger("vllm").handlers if hasattr(h, "path"))
    assert "No available memory for the cache blocks" in "".join(logged)
    _log_error("later error")  # the handler is gone; a forked engine core still has it, and its file is gone
    child = context.Process(target=_log_error, args=("after the start",))
    child.start()
    child.join()
    assert not os.path.exists(path)


def test_start_log_gives_spawned_processes_vllms_logging_config_plus_its_file(monkeypatch):
    """On the CPU vLLM spawns its engine core: it reads VLLM_LOGGING_CONFIG_PATH, not our handlers."""
    pytest.importorskip("vllm.logger")
    import json

    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    with start_log():
        path = next(h.path for h in logging.getLogger("vllm").handlers if hasattr(h, "path"))
        with open(os.environ["VLLM_LOGGING_CONFIG_PATH"], encoding="utf-8") as handle:
            config = json.load(handle)
    assert config["handlers"]["qbatch_start"]["filename"] == path
    assert config["loggers"]["vllm"]["handlers"] == ["vllm", "qbatch_start"]
    assert "VLLM_LOGGING_CONFIG_PATH" not in os.environ


def test_a_data_parallel_worker_passes_on_the_kind_and_hint():
    from qbatch.engines.messages import Failed
    from qbatch.engines.processes import start_failure

    error = start_error("m", ValueError(GPU_NOT_FREE))
    message = pickle.loads(pickle.dumps(Failed(1, str(error), error)))  # as the worker's queue does
    failure = start_failure(message)
    assert isinstance(failure, EngineError) and failure.hint == MEMORY_HINT
    assert failure.message.startswith("engine worker 1 could not start: not enough memory")
    assert isinstance(start_failure(Failed(0, "boom")), ModelError)


@pytest.mark.slow
def test_a_real_engine_without_kv_cache_memory_says_so(cli, write_jsonl, tmp_path):
    path = write_jsonl([{"prompt": "hi"}])
    result = cli("run", path, "-o", tmp_path / "out", "--model", "smollm2-135m", "--max-tokens", "4",
                 "--kv-cache-memory-bytes", "1000", "--progress", "none")
    assert result.exit_code == EXIT_ENGINE
    assert "Error: not enough memory to start the engine for model 'smollm2-135m': ValueError: No available memory " \
           "for the cache blocks" in result.output
    assert f"Hint: {MEMORY_HINT}" in result.output
    # vLLM's output went to the engine log; its last lines, the engine core's error among them, show with the error
    tail = result.output.split(f"vLLM's last 20 lines ({tmp_path / 'out' / 'engine.log'}):\n", 1)[1]
    assert "ValueError: No available memory for the cache blocks" in tail.split("\nError: ")[0]


def test_a_ray_actor_that_ran_out_of_memory_says_so():
    from qbatch.engines.ray_actors import _raise_if_memory

    with pytest.raises(EngineError) as info:
        _raise_if_memory(RuntimeError("Task was killed due to the node running low on memory.\nMemory on the node"))
    assert info.value.hint == MEMORY_HINT
    assert info.value.message == ("an engine actor ran out of memory while starting: "
                                  "Task was killed due to the node running low on memory.")
    _raise_if_memory(RuntimeError("No module named 'vllm'"))  # not memory: the caller's own error follows
