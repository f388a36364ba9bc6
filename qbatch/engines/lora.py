"""LoRA adapters in a vLLM engine: each request's LoRARequest (qbatch/plan/engine_args.py decides the
LLM(...) arguments that enable them).

A job's adapters (EngineSpec.lora) are numbered in the order of their names, so every engine of a
job (data-parallel workers, Ray actors) gives an adapter the same vLLM id; rows travel with their
adapter's name (Request.adapter) and each engine turns it into vLLM's LoRARequest here. Each engine loads
every adapter when it starts (load): one vLLM cannot load fails its own rows there, not the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from qbatch.errors import first_line
from qbatch.log import log
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
        self._failed: dict[str, str] = {}  # adapters vLLM could not load: what it said
        if adapters:
            from vllm.lora.request import LoRARequest

            folders = dict(adapters)
            self._requests = {name: LoRARequest(name, number, folders[name])
                              for name, number in adapter_ids(folders).items()}

    def __contains__(self, adapter: str) -> bool:
        return adapter in self._requests

    def load(self, engine: Any, dead: tuple[type[BaseException], ...] = ()) -> None:
        """Each adapter loaded into `engine` (vLLM's LLMEngine) now. vLLM would load one when its first row
        runs, inside the engine's step, where an adapter it cannot load kills the engine and every row with
        it (models/adapter_weights.py finds most such weights before: this is for the rest). Here its
        failure comes back as an error, and the adapter's rows fail alone (get). `dead`: the errors that say
        the engine itself died (those stop the run)."""
        for name, request in self._requests.items():
            try:
                engine.add_lora(request)
            except dead:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever vLLM raised, the adapter's rows say it
                self._failed[name] = f"adapter {name} ({request.lora_path}) did not load in vLLM: {first_line(exc)}"
                log.warning("%s; its rows fail, the others run", self._failed[name])

    def get(self, adapter: str | None) -> Any:
        """The LoRARequest of a row's adapter (a name the job checked: inputs/prepare.py), None for the base;
        ValueError for an adapter vLLM could not load (the engine fails the row with it)."""
        if adapter is None:
            return None
        if adapter in self._failed:
            raise ValueError(self._failed[adapter])
        return self._requests[adapter]

