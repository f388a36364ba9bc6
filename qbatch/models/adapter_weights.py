"""A LoRA adapter's weights checked against its config and the base model before any engine loads them, from the
safetensors headers alone (a little-endian length, then JSON: names, dtypes and shapes; no tensor is read).

vLLM reads an adapter's weights when its first row runs, in the engine process: weights it cannot load (an
empty or truncated file, a rank other than the config's `r`, modules the model lacks, shapes of another model)
kill the engine there, and every row of the run with it. Found here, they fail that adapter's rows alone.
Torch pickles (.bin, .pt) cannot be read without loading them: vLLM checks those (engines/lora.py).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SAFETENSORS_FILE = "adapter_model.safetensors"
TORCH_FILES = ("adapter_model.bin", "adapter_model.pt")  # vLLM reads these when there is no .safetensors
WEIGHT_FILES = (SAFETENSORS_FILE, *TORCH_FILES)
# LoRA weights are matrices of real numbers: vLLM casts them to the model's dtype, and an integer or 8-bit
# tensor cast so is not the adapter that was trained
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
LORA_SUFFIXES = {"lora_A.weight": "A", "lora_B.weight": "B", "lora_embedding_A": "A", "lora_embedding_B": "B"}
# copies of the base model's embeddings some PEFT versions save beside the adapter: vLLM skips them
BASE_EMBEDDINGS = (".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")
HEADER_MAX_BYTES = 100_000_000  # safetensors' own limit
SAVE_AGAIN = "save the adapter again (PEFT's save_pretrained)"
OTHER_MODEL = "use an adapter trained on this --model"


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header (tensor name -> dtype, shape, offsets); ValueError saying why it is unreadable."""
    size = path.stat().st_size
    if size == 0:
        raise ValueError("it is empty (0 bytes)")
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"it is {size} bytes, shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(HEADER_MAX_BYTES, size - 8):
            raise ValueError(f"its header says {length} bytes, more than the file holds: it is not safetensors, "
                             "or it was cut short")
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            raise ValueError("its header is not JSON: it is not a safetensors file") from None
    if not isinstance(header, dict) or not all(isinstance(v, dict) for k, v in header.items() if k != "__metadata__"):
        raise ValueError("its header is not a table of tensors: it is not a safetensors file")
    return {key: value for key, value in header.items() if key != "__metadata__"}


def tensor_shapes(path: Path) -> dict[str, list[int]]:
    """A safetensors file's tensors' shapes by name, from its header."""
    return {key: value["shape"] for key, value in safetensors_header(path).items()}


@dataclass(frozen=True)
class ModelLayers:
    """The base model's layers a LoRA adapter can change (those with a matrix: its linear layers and
    embeddings, vLLM's rule), by their last name (q_proj), and each one's weight shape (out, in) by its name."""

    names: frozenset[str]
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def read(cls, model_path: str) -> ModelLayers | None:
        """From the model's safetensors headers; None when the folder has none (a hub name, .bin weights)."""
        files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
        if not files:
            return None
        names: set[str] = set()
        shapes: dict[str, tuple[int, int]] = {}
        for file in files:
            for key, shape in tensor_shapes(file).items():
                module, _, kind = key.rpartition(".")
                if len(shape) < 2 or not module:  # norms and biases: vectors, which no LoRA changes
                    continue
                names.add(module.rsplit(".", 1)[-1])  # q_proj's weight, or a quantized model's qweight
                if kind == "weight" and len(shape) == 2:
                    shapes[module] = (shape[0], shape[1])
        if "embed_tokens" in names:  # tied embeddings: lm_head has no weight of its own, vLLM still has the layer
            names.add("lm_head")
        return cls(frozenset(names), shapes)


@dataclass(frozen=True)
class AdapterShape:
    """What an adapter's config says its weights are: the rank (and the per-module ranks of rank_pattern), and
    the modules it targets (None: a regular expression or all-linear, which name no module to check)."""

    rank: int
    rank_pattern: dict[str, int]
    target_modules: tuple[str, ...] | None

    def rank_of(self, module: str) -> int:
        """PEFT's rule: a rank_pattern key matches a module whose name ends with it at a dot; the first wins."""
        for key, rank in self.rank_pattern.items():
            if re.match(rf"(.*\.)?({key})$", module):
                return rank
        return self.rank


def weights_problem(folder: Path, shape: AdapterShape, model: ModelLayers | None) -> str | None:
    """What is wrong with the adapter's weights, and how to fix it ("...; save the adapter again"); None: nothing
    found (a .bin or .pt file is only checked not to be empty)."""
    path = folder / SAFETENSORS_FILE
    if not path.is_file():
        torch_file = next((folder / name for name in TORCH_FILES if (folder / name).is_file()), None)
        if torch_file is None:
            return f"the folder has no weights ({', '.join(WEIGHT_FILES)}); pass the folder PEFT's save_pretrained wrote"
        return f"{torch_file.name} is empty (0 bytes); {SAVE_AGAIN}" if torch_file.stat().st_size == 0 else None
    try:
        header = safetensors_header(path)
    except (OSError, ValueError) as exc:
        return f"{SAFETENSORS_FILE} cannot be read: {exc}; {SAVE_AGAIN}"
    if not header:
        return f"{SAFETENSORS_FILE} holds no tensors; {SAVE_AGAIN}"
    return _tensor_problem(header, shape, model) or _module_problem(header, shape, model)


def _tensor_problem(header: dict[str, Any], shape: AdapterShape, model: ModelLayers | None) -> str | None:
    """The first tensor that is not a LoRA matrix of the config's rank (and, known, of the model's shapes)."""
    for key, info in sorted(header.items()):
        parsed = lora_name(key)
        if parsed is None:
            if key.endswith(BASE_EMBEDDINGS):
                continue
            return f"{SAFETENSORS_FILE} holds {key}, which is not a LoRA weight (…lora_A.weight, …lora_B.weight); {SAVE_AGAIN}"
        module, side = parsed
        dims = info.get("shape")
        if info.get("dtype") not in FLOAT_DTYPES:
            return (f"{key} is {info.get('dtype')}; LoRA weights are floating point ({', '.join(FLOAT_DTYPES)}): "
                    "save the adapter in one of them")
        if not isinstance(dims, list) or len(dims) != 2:
            return f"{key} has shape {dims}, not a matrix; {SAVE_AGAIN}"
        rank = dims[0] if side == "A" else dims[1]
        expected = shape.rank_of(module)
        if rank != expected:
            return (f"{key} has rank {rank} (shape {dims}) but adapter_config.json says r = {expected}; "
                    "save the adapter again, or set r to its weights' rank")
        layer = model.shapes.get(module) if model is not None and key.endswith(".weight") else None
        if layer is not None and (dims[1] if side == "A" else dims[0]) != layer[1 if side == "A" else 0]:
            features = f"takes {layer[1]} inputs" if side == "A" else f"gives {layer[0]} outputs"
            return f"{key} has shape {dims} but the base model's {module} {features}; {OTHER_MODEL}"
    return None


def _module_problem(header: dict[str, Any], shape: AdapterShape, model: ModelLayers | None) -> str | None:
    """Modules whose weights are not the config's targets or not layers of the model; a lora_A without its lora_B."""
    sides: dict[str, set[str]] = {}
    for key in header:
        parsed = lora_name(key)
        if parsed is not None:
            sides.setdefault(parsed[0], set()).add(parsed[1])
    unpaired = sorted(module for module, found in sides.items() if found != {"A", "B"})
    if unpaired:
        return f"{unpaired[0]} has lora_{''.join(sides[unpaired[0]])} only, not both lora_A and lora_B; {SAVE_AGAIN}"
    names = {module.rsplit(".", 1)[-1] for module in sides}
    if shape.target_modules is not None:
        untargeted = sorted(names - {t.rsplit(".", 1)[-1] for t in shape.target_modules})
        if untargeted:
            return (f"the weights hold modules adapter_config.json's target_modules does not name: "
                    f"{', '.join(untargeted)}; {SAVE_AGAIN}, or list them in target_modules")
    missing = sorted(names - model.names) if model is not None else []
    if missing:
        return f"the weights hold modules the base model does not have: {', '.join(missing)}; {OTHER_MODEL}"
    return None


def lora_name(key: str) -> tuple[str, str] | None:
    """A LoRA weight's module (model.layers.0.self_attn.q_proj) and side ("A" or "B"), as vLLM parses it
    (vllm/lora/utils.py, parse_fine_tuned_lora_name); None for any other tensor."""
    name = key.removeprefix("base_model.model.")
    for suffix, side in LORA_SUFFIXES.items():
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], side
    return None
