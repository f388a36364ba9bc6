"""Where engines run on this host: which GPUs, how much memory they have, and how many engines share each.

A small model leaves its GPU idle for part of each step while vLLM's engine loop runs
on the CPU, so by default such a model gets two engines per GPU, each with half of the
GPU's memory (docs/benchmarks.md has the measurements).
"""

from __future__ import annotations

import os
import subprocess

from qbatch.spec import EngineSpec

# Two engines per GPU when the weights take at most this share of its memory (the KV cache
# of each engine stays large) and the host has SHARED_GPU_CORES cores per engine.
SHARED_GPU_MAX_WEIGHTS = 0.02
SHARED_GPU_CORES = 4


def engines_per_gpu(spec: EngineSpec, weights_bytes: int | None) -> int:
    """The engines to run on each GPU: the spec's choice, else 2 for a small model on a large GPU.

    weights_bytes: the size of the model's weights (None: not known, one engine per GPU).
    """
    if spec.engines_per_gpu is not None:
        return spec.engines_per_gpu
    if spec.backend != "vllm" or spec.tensor_parallel_size > 1 or not weights_bytes:
        return 1
    memory = gpu_memory_bytes(gpu_ids(spec)[0])
    cores = len(os.sched_getaffinity(0))
    if memory and weights_bytes <= SHARED_GPU_MAX_WEIGHTS * memory \
            and cores >= SHARED_GPU_CORES * 2 * spec.data_parallel_size:
        return 2
    return 1


def gpu_memory_bytes(device: str) -> int | None:
    """Total memory of an NVIDIA GPU (CUDA stays uninitialised); None without one."""
    rows = query_gpus("memory.total", device)
    return rows[0][0] << 20 if rows else None  # MiB


def query_gpus(fields: str, devices: str | None = None) -> list[list[int]] | None:
    """Integer fields of each GPU (all, or `devices`: ids as in CUDA_VISIBLE_DEVICES), asked through
    nvidia-smi; None without an NVIDIA GPU."""
    command = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(command + (["-i", devices] if devices else []), capture_output=True, text=True,
                             timeout=30, check=True).stdout
        return [[int(x) for x in line.split(",")] for line in out.splitlines() if line.strip()] or None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def gpu_ids(spec: EngineSpec) -> list[str]:
    """The GPUs to use: --gpus, else the first N that CUDA_VISIBLE_DEVICES shows, else 0..N-1."""
    if spec.gpus:
        return list(spec.gpus)
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if len(visible) >= spec.data_parallel_size:
        return visible[:spec.data_parallel_size]
    return [str(i) for i in range(spec.data_parallel_size)]
