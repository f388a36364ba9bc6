"""vLLM's compile cache under $QBATCH_CACHE, and the markers that say a compile is cached."""

from __future__ import annotations

import os
import subprocess
import sys

from qbatch.engines import compile_cache
from qbatch.spec import EngineSpec


def test_cache_root_follows_qbatch_cache_unless_vllm_cache_root_is_set(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("QBATCH_CACHE", str(tmp_path / "q"))
    assert compile_cache.cache_root() == tmp_path / "q" / "vllm"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "mine"))
    assert compile_cache.cache_root() == tmp_path / "mine"


def test_engines_point_vllm_at_it_before_vllm_reads_it(tmp_path):
    """In a fresh process (vLLM reads the variable when asked, its engine processes inherit it)."""
    code = ("import os; from qbatch.engines import compile_cache; compile_cache.use_cache_root(); "
            "import vllm.envs as envs; print(envs.VLLM_CACHE_ROOT)")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CACHE_ROOT"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "QBATCH_CACHE": str(tmp_path)},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()[-1]
    assert out == str(tmp_path / "vllm")
    out = subprocess.run([sys.executable, "-c", code], env={**env, "QBATCH_CACHE": str(tmp_path),
                                                            "VLLM_CACHE_ROOT": str(tmp_path / "mine")},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()[-1]
    assert out == str(tmp_path / "mine")


def test_a_compiled_start_marks_the_settings_warm(tmp_path, monkeypatch):
    def settings(spec, max_model_len):
        return compile_cache.marker_settings(spec, "/m", max_model_len, compile_cache.vllm_version())

    def is_warm(spec, max_model_len):
        return compile_cache.marker_name(settings(spec, max_model_len)) in compile_cache.warm_markers()

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    spec = EngineSpec(compilation_mode=3)
    assert not is_warm(spec, 4096)
    compile_cache.note_compiled(settings(spec, 4096))
    assert is_warm(spec, 4096)
    assert is_warm(spec.one_engine(gpu_memory_utilization=0.45), 4096)  # KV size: same graphs
    assert not is_warm(spec, 8192)
    assert not is_warm(EngineSpec(compilation_mode=3, max_num_seqs=256), 4096)
