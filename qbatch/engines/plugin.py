"""What qbatch adds to vLLM in each of vLLM's processes: vLLM loads `register` from the
`vllm.general_plugins` entry point (pyproject.toml) in the process that builds an engine, its engine
core and its workers, where a model class must be known by name.

It adds one model architecture, FUSED_QWEN3 (qwen3_fused.py), which no model's config names: an
engine runs it only where qbatch asks for it in `hf_overrides` (plan/engine_args.py). Anything else
vLLM runs in this environment, a user's own script included, is left as it was.
"""

from __future__ import annotations

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN = "qbatch.engines.plugin:register"  # as pyproject.toml names it
FUSED_QWEN3 = "QbatchQwen3ForCausalLM"
# A model's architecture (its config.json) -> qbatch's class of it with the q/k norms and RoPE fused
FUSED_ARCHITECTURES = {"Qwen3ForCausalLM": FUSED_QWEN3}
_CLASS = "qbatch.engines.qwen3_fused:FusedQkQwen3ForCausalLM"


def register() -> None:
    """vLLM's plugin hook: name qbatch's model class (imported only when an engine builds it).
    vLLM may call this more than once in a process."""
    from vllm import ModelRegistry

    if FUSED_QWEN3 not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(FUSED_QWEN3, _CLASS)
