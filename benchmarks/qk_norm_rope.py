"""Does qbatch's Qwen3 attention with q/k norms and RoPE in one kernel (qbatch/engines/qwen3_fused.py)
compute what vLLM's own does on this GPU, and how much faster is that part of it?

`python benchmarks/qk_norm_rope.py [--dtype float16] [TOKENS ...]` (default 256 and 32768: a decode step, a
prefill step): one attention layer of Qwen3-0.6B's shape (16 heads, 8 KV heads of 128, RoPE theta 1e6) built
from vLLM's own RMSNorm and RoPE, the projections left out (the input is the qkv tensor itself), random values
(bf16 unless --dtype says) and positions. For each size: the largest and mean difference of q, k and v between
vLLM's forward and the fused one, and each one's GPU time per call (CUDA events, the mean of 50 calls after 5).
"""

from __future__ import annotations

import argparse
import copy

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.qwen3 import Qwen3Attention

from qbatch.engines import qwen3_fused

HEADS, KV_HEADS, HEAD, MAX_POSITION = 16, 8, 128, 40960


class Identity(torch.nn.Module):
    def forward(self, x):
        return x, None


class Attend(torch.nn.Module):
    """Stands for the attention kernel: q, k and v side by side (compare) or q alone (time)."""

    whole = True

    def forward(self, q, k, v):
        return torch.cat([q, k, v], dim=-1) if self.whole else q


def layer(dtype: torch.dtype) -> Qwen3Attention:
    attention = Qwen3Attention.__new__(Qwen3Attention)
    torch.nn.Module.__init__(attention)
    attention.num_heads, attention.num_kv_heads, attention.head_dim = HEADS, KV_HEADS, HEAD
    attention.q_size, attention.kv_size = HEADS * HEAD, KV_HEADS * HEAD
    with set_current_vllm_config(VllmConfig()):
        attention.q_norm = RMSNorm(HEAD, eps=1e-6, dtype=dtype)
        attention.k_norm = RMSNorm(HEAD, eps=1e-6, dtype=dtype)
        attention.rotary_emb = copy.deepcopy(get_rope(HEAD, max_position=MAX_POSITION, is_neox_style=True,
                                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    for norm in (attention.q_norm, attention.k_norm):
        norm.weight.data = (0.5 + torch.rand(HEAD)).to(dtype)
    attention.qkv_proj, attention.o_proj, attention.attn = Identity(), Identity(), Attend()
    return attention.cuda()


def gpu_ms(call, repeats: int = 50) -> float:
    for _ in range(5):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main(sizes: list[int], dtype: torch.dtype) -> None:
    vllms, fused = layer(dtype), layer(dtype)
    fused.load_state_dict(vllms.state_dict())
    print("fused layers:", qwen3_fused.fuse(torch.nn.Sequential(fused), qwen3_fused.kernel()))
    for tokens in sizes:
        torch.manual_seed(tokens)
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD, dtype=dtype, device="cuda")
        positions = torch.randint(0, MAX_POSITION, (tokens,), device="cuda")
        Attend.whole = True
        expected = Qwen3Attention.forward(vllms, positions, qkv.clone()).float()
        got = fused(positions, qkv.clone()).float()
        diff = (got - expected).abs()
        Attend.whole = False
        vllm_ms = gpu_ms(lambda: Qwen3Attention.forward(vllms, positions, qkv.clone()))
        fused_ms = gpu_ms(lambda: fused(positions, qkv.clone()))
        copy_ms = gpu_ms(lambda: qkv.clone())
        print(f"{tokens} tokens: max |diff| {diff.max().item():.4f}, mean {diff.mean().item():.6f} "
              f"(values: mean |x| {expected.abs().mean().item():.3f}); per call, less the input's copy "
              f"({copy_ms:.3f} ms): vLLM's {vllm_ms - copy_ms:.3f} ms, fused {fused_ms - copy_ms:.3f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="qbatch's fused q/k norms and RoPE against vLLM's forward")
    parser.add_argument("tokens", nargs="*", type=int, default=[256, 32768])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = parser.parse_args()
    main(args.tokens, getattr(torch, args.dtype))
