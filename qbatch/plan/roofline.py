"""What a GPU can do at best for a job: a roofline from the model's size, the KV cache each output token
reads, and the GPU's memory bandwidth and matrix FLOPs (the method: docs/how-it-works/roofline.md).

GPU utilization says "busy" whether the GPU does useful work or not; a run's share of its roofline says
how close it came to what the chip allows. The job's time is at least the larger of
- its memory time: every decode step reads the KV cache of each running row's context (a row of p prompt
  and o output tokens reads kv * (p*o + o*o/2) bytes over its decode) and the weights once a step
  (STEP_ROWS rows a step), over the GPU's bandwidth;
- its compute time: 2 FLOPs per parameter per token, prompt and output, plus attention's, over the GPU's
  dense bf16 rate.
It ignores what a real engine adds (the scheduler, sampling, kernels below the chip's peak), so a run
reaches a share of it, never more. No GPU, or one not in GPUS: no roofline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STEP_ROWS = 1024  # rows a decode step, as vLLM's max_num_seqs on a large GPU: what the weights' read is shared by
KV_BYTES = 2  # a bf16 KV cache


@dataclass(frozen=True)
class GpuPeak:
    """A GPU's datasheet peaks: memory bandwidth (bytes/s) and dense bf16 matrix rate (FLOP/s)."""

    name: str
    bandwidth: float
    flops: float


# Matched by the name nvidia-smi gives, first match wins (the datasheets' SXM figures unless the name says PCIe/NVL)
GPUS = (GpuPeak("H200", 4.8e12, 989e12), GpuPeak("H100 PCIe", 2.0e12, 756e12), GpuPeak("H100 NVL", 3.9e12, 835e12),
        GpuPeak("H100", 3.35e12, 989e12), GpuPeak("A100-SXM4-80GB", 2.039e12, 312e12),
        GpuPeak("A100 80GB PCIe", 1.935e12, 312e12), GpuPeak("A100", 1.555e12, 312e12),
        GpuPeak("L40S", 0.864e12, 362e12), GpuPeak("L4", 0.3e12, 121e12), GpuPeak("A10", 0.6e12, 125e12),
        GpuPeak("RTX 4090", 1.008e12, 165e12))


def gpu_peak(gpu_name: str | None) -> GpuPeak | None:
    """The peaks of a GPU by its name (nvidia-smi's); None for no GPU or one qbatch has no figures for."""
    if not gpu_name:
        return None
    return next((gpu for gpu in GPUS if gpu.name.lower() in gpu_name.lower()), None)


@dataclass(frozen=True)
class ModelCost:
    """What a token costs a model: its weights (read once a decode step), its parameters (FLOPs), the KV
    cache a token of context holds, and attention's FLOPs per token of context."""

    weights_bytes: int
    params: int
    kv_bytes_per_token: int
    attention_flops_per_context: int

    @classmethod
    def of_config(cls, config: dict[str, Any], weights_bytes: int | None) -> ModelCost | None:
        """From a model's config.json (its text model's part); None where it lacks the sizes."""
        try:
            layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
            head_dim = config.get("head_dim") or config["hidden_size"] // heads
            kv_heads = config.get("num_key_value_heads") or heads
        except (KeyError, TypeError, ZeroDivisionError):
            return None
        if not weights_bytes:
            return None
        return cls(weights_bytes, weights_bytes // 2, 2 * layers * kv_heads * head_dim * KV_BYTES,
                   4 * layers * heads * head_dim)


@dataclass(frozen=True)
class Work:
    """A job's tokens as the roofline counts them: prompt and output tokens, the output tokens' contexts
    (the sum over output tokens of the tokens before each: sum of p*o + o*(o-1)/2 a row) and the prompts'
    own (sum of p*(p-1)/2 a row, for prefill attention)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    decode_context: int = 0
    prefill_context: int = 0

    @classmethod
    def of_rows(cls, rows: list[tuple[int, int]]) -> Work:
        """From (prompt tokens, output tokens) a row."""
        return cls(sum(p for p, _ in rows), sum(o for _, o in rows), sum(p * o + o * (o - 1) // 2 for p, o in rows),
                   sum(p * (p - 1) // 2 for p, _ in rows))

    def plus(self, other: Work) -> Work:
        return Work(self.prompt_tokens + other.prompt_tokens, self.output_tokens + other.output_tokens,
                    self.decode_context + other.decode_context, self.prefill_context + other.prefill_context)


@dataclass(frozen=True)
class Roofline:
    """The least time a job's work takes on `gpus` GPUs, and which ceiling sets it."""

    seconds: float
    bound: str  # "memory" or "compute"
    gpu: str
    gpus: int

    def share(self, measured_s: float) -> float | None:
        """How close a run of `measured_s` came to the roofline (1.0: at it)."""
        return self.seconds / measured_s if measured_s > 0 else None


def roofline(work: Work, model: ModelCost, gpu: GpuPeak, gpus: int = 1) -> Roofline:
    """The roofline time of `work` on `gpus` GPUs of this kind (the work split evenly)."""
    steps = work.output_tokens / STEP_ROWS
    memory_bytes = work.decode_context * model.kv_bytes_per_token + steps * model.weights_bytes
    flops = (2 * model.params * (work.prompt_tokens + work.output_tokens)
             + model.attention_flops_per_context * (work.decode_context + work.prefill_context))
    memory_s, compute_s = memory_bytes / gpu.bandwidth, flops / gpu.flops
    bound = "memory" if memory_s >= compute_s else "compute"
    return Roofline(max(memory_s, compute_s) / max(gpus, 1), bound, gpu.name, max(gpus, 1))

