"""LoRA adapters in a vLLM engine: each request's LoRARequest (qbatch/plan/engine_args.py decides the
LLM(...) arguments that enable them).

A job's adapters (EngineSpec.lora) are numbered in the order of their names, so every engine of a
job (data-parallel workers, Ray actors) gives an adapter the same vLLM id; rows travel with their
adapter's name (Request.adapter) and each engine turns it into vLLM's LoRARequest here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from qbatch.spec import EngineSpec

# An engine serves this many adapters in one batch at most unless --max-loras says more: each slot holds
# max_lora_rank-sized weights for every target module, in the GPU's memory, whether a batch uses it or not.
MAX_LORAS_CAP = 8


def batch_adapters(spec: EngineSpec) -> int:
    """Adapters one batch of the engine can mix (vLLM's max_loras): --max-loras, else the adapters given,
    at most MAX_LORAS_CAP."""
    return spec.max_loras or min(len(spec.lora or ()), MAX_LORAS_CAP) or 1


def adapter_ids(names: Iterable[str]) -> dict[str, int]:
    """Each adapter's vLLM id (1, 2, ...: 0 is no adapter), by its name's order."""
    return {name: number for number, name in enumerate(sorted(names), start=1)}


class LoraRequests:
    """vLLM's LoRARequest for each of the job's adapters, made once; None for the base model."""

    def __init__(self, adapters: tuple[tuple[str, str], ...] = ()):
        """`adapters`: (name, folder) of each (EngineConfig.lora)."""
        self._requests: dict[str, Any] = {}
        if adapters:
            from vllm.lora.request import LoRARequest

            folders = dict(adapters)
            self._requests = {name: LoRARequest(name, number, folders[name])
                              for name, number in adapter_ids(folders).items()}

    def __contains__(self, adapter: str) -> bool:
        return adapter in self._requests

    def get(self, adapter: str | None) -> Any:
        """The LoRARequest of a row's adapter (a name the job checked: inputs/prepare.py), None for the base."""
        return None if adapter is None else self._requests[adapter]
