"""LoRA adapters in a vLLM engine: the LLM(...) arguments that enable them, and each request's LoRARequest.

A job's adapters (EngineSpec.lora) are numbered in the order of their names, so every engine of a
job (data-parallel workers, Ray actors) gives an adapter the same vLLM id; rows travel with their
adapter's name (Request.adapter) and each engine turns it into vLLM's LoRARequest here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qbatch.engines.platform import on_cpu
from qbatch.spec import EngineSpec

# An engine serves this many adapters in one batch at most unless --max-loras says more: each slot holds
# max_lora_rank-sized weights for every target module, in the GPU's memory, whether a batch uses it or not.
MAX_LORAS_CAP = 8


def lora_kwargs(spec: EngineSpec) -> dict[str, Any]:
    """LLM(...) keyword arguments for the job's adapters (vLLM's names); none without adapters. The sizes
    the user left out are chosen here from the adapters' number (models/adapters.py sets the rank)."""
    if not spec.lora:
        return {}
    max_loras = batch_adapters(spec)
    if on_cpu():
        # vLLM 0.32's CPU LoRA ops pick a decoding base row's weights from slot -1, the last adapter slot
        # (lora_ops.bgmv_*: Python indexing), so a base row decodes with whichever adapter sits there. One
        # slot more than the adapters stays empty (zeros): base rows then decode as the base model does.
        max_loras = max(max_loras, len(spec.lora)) + 1
    # max_cpu_loras: every adapter stays in memory, none read again from its folder (vLLM: at least max_loras)
    kwargs: dict[str, Any] = {"enable_lora": True, "max_loras": max_loras,
                              "max_cpu_loras": max(spec.max_cpu_loras or len(spec.lora), max_loras)}
    if spec.max_lora_rank is not None:
        kwargs["max_lora_rank"] = spec.max_lora_rank
    return kwargs


def batch_adapters(spec: EngineSpec) -> int:
    """Adapters one batch of the engine can mix (vLLM's max_loras): --max-loras, else the adapters given,
    at most MAX_LORAS_CAP."""
    return spec.max_loras or min(len(spec.lora or ()), MAX_LORAS_CAP) or 1


def adapter_ids(spec: EngineSpec) -> dict[str, int]:
    """Each adapter's vLLM id (1, 2, ...: 0 is no adapter), by its name's order."""
    return {name: number for number, name in enumerate(sorted(spec.lora or {}), start=1)}


class LoraRequests:
    """vLLM's LoRARequest for each of the job's adapters, made once; None for the base model."""

    def __init__(self, spec: EngineSpec | None = None):
        self._requests: dict[str, Any] = {}
        if spec is not None and spec.lora:
            from vllm.lora.request import LoRARequest

            folders = spec.lora
            self._requests = {name: LoRARequest(name, number, str(Path(folders[name]).resolve()))
                              for name, number in adapter_ids(spec).items()}

    def get(self, adapter: str | None) -> Any:
        """The LoRARequest of a row's adapter (a name the job checked: inputs/prepare.py), None for the base."""
        return None if adapter is None else self._requests[adapter]
