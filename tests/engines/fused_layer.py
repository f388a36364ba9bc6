"""A Qwen3 attention layer of vLLM's own parts for test_qwen3_fused.py, and a reference for the fused
kernel. Imported by its tests only (it imports torch and vLLM: seconds that collecting the suite need not pay)."""

from __future__ import annotations

import copy

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.models.qwen3 import Qwen3Attention

HEADS, KV_HEADS, HIDDEN = 4, 2, 64


class Projection(torch.nn.Module):
    """vLLM's linear layers return (output, bias)."""

    def __init__(self, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (x if self.weight is None else x @ self.weight), None


class Attend(torch.nn.Module):
    """Stands for the attention kernel: hands back what it was given, q, k and v side by side."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat([q, k, v], dim=-1)


def reference_kernel(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache,
                     is_neox, position_ids, forced_token_heads_per_warp):
    """fused_qk_norm_rope as vLLM's compile pass documents it (qk_norm_rope_fusion.py), in torch."""
    q_size, k_size = num_heads_q * head_dim, num_heads_k * head_dim
    q, k = qkv[:, :q_size], qkv[:, q_size:q_size + k_size]
    normed = []
    for x, heads, weight in ((q, num_heads_q, q_weight), (k, num_heads_k, k_weight)):
        by_head = x.float().reshape(-1, heads, head_dim)
        by_head = by_head * torch.rsqrt(by_head.pow(2).mean(-1, keepdim=True) + eps)
        normed.append((by_head.to(weight.dtype) * weight).reshape(x.shape))
    rotated = RotaryEmbedding.forward_static(position_ids, normed[0], normed[1], head_dim, head_dim, cos_sin_cache,
                                             is_neox)
    qkv[:, :q_size], qkv[:, q_size:q_size + k_size] = rotated
    assert num_heads_v == num_heads_k and forced_token_heads_per_warp == -1


def layer(head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, neox: bool = True) -> Qwen3Attention:
    """A Qwen3 attention layer of vLLM's own norms and RoPE, random weights, tiny linear stand-ins."""
    torch.manual_seed(0)
    attention = Qwen3Attention.__new__(Qwen3Attention)
    torch.nn.Module.__init__(attention)
    attention.num_heads, attention.num_kv_heads, attention.head_dim = HEADS, KV_HEADS, head_dim
    attention.q_size, attention.kv_size = HEADS * head_dim, KV_HEADS * head_dim
    width = attention.q_size + 2 * attention.kv_size
    with set_current_vllm_config(VllmConfig()):
        attention.q_norm = RMSNorm(head_dim, eps=1e-6, dtype=dtype)
        attention.k_norm = RMSNorm(head_dim, eps=1e-6, dtype=dtype)
        # a copy: get_rope hands every caller of the same settings one shared object
        attention.rotary_emb = copy.deepcopy(get_rope(head_dim, max_position=256, is_neox_style=neox,
                                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    for norm in (attention.q_norm, attention.k_norm):
        norm.weight.data = (1 + torch.rand(head_dim)).to(dtype)
    attention.qkv_proj = Projection(torch.randn(HIDDEN, width, dtype=dtype) / 8)
    attention.attn, attention.o_proj = Attend(), Projection()
    return attention
