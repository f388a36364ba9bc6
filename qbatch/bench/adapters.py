"""Random LoRA adapters for a base model, in PEFT's folder layout: for benchmarks (adapters mixed in one job
against the base model alone) and tests (an adapter whose answers differ from the base model's).

The adapter's shapes come from the base model's own weights (their safetensors headers), so any model
folder gets adapters that vLLM loads: lora_A (rank x in) and lora_B (out x rank) for each target module.
"""

from __future__ import annotations

import json
from pathlib import Path

from qbatch.models.adapter_weights import tensor_shapes
from qbatch.models.adapters import CONFIG_FILE

TARGET_MODULES = ("q_proj", "v_proj")


def write_random_adapter(folder: str | Path, model_path: str, *, rank: int = 8, seed: int = 0,
                         scale: float = 0.5, targets: tuple[str, ...] = TARGET_MODULES) -> Path:
    """A random adapter of `rank` for the model in `model_path`, written to `folder` (seeded: the same
    seed writes the same adapter). `scale` sizes its weights: large enough to change greedy answers."""
    import torch
    from safetensors.torch import save_file

    shapes = _weight_shapes(Path(model_path), targets)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out_features, in_features) in sorted(shapes.items()):
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * scale
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * scale
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
              "target_modules": list(targets), "base_model_name_or_path": str(model_path), "bias": "none",
              "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


def _weight_shapes(model: Path, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Each target module's (out, in) features, by its name in the model (model.layers.0.self_attn.q_proj)."""
    shapes: dict[str, tuple[int, int]] = {}
    for file in sorted(model.glob("*.safetensors")):
        for key, shape in tensor_shapes(file).items():
            module, _, kind = key.rpartition(".")
            if kind == "weight" and module.rsplit(".", 1)[-1] in targets and len(shape) == 2:
                shapes[module] = (shape[0], shape[1])
    if not shapes:
        shapes = _config_shapes(model, targets)
    if not shapes:
        raise ValueError(f"no {', '.join(targets)} weights in the safetensors files of {model}")
    return shapes


def _config_shapes(model: Path, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """The attention projections' shapes from config.json, for a folder without weights (a model run with
    load_format dummy): a Llama-style decoder's model.layers.N.self_attn.{q,k,v,o}_proj."""
    config_file = model / "config.json"
    if not config_file.is_file():
        return {}
    config = json.loads(config_file.read_text(encoding="utf-8"))
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    features = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
                "o_proj": (hidden, heads * head_dim)}
    return {f"model.layers.{layer}.self_attn.{name}": features[name]
            for layer in range(config["num_hidden_layers"]) for name in targets if name in features}


ADAPTER_RANK = 16  # a common fine-tune's rank (PEFT's examples use 8 to 64)


def adapters_workload(path: Path, num_adapters: int, model: str | None) -> tuple[Path, dict[str, str]]:
    """The workload's JSONL with an `adapter` column naming adapter0..N-1 in turn, beside it, and N random
    adapters of the model (written once, seeded by their number); the --lora table that names them."""
    from qbatch.models import registry
    from qbatch.spec import DEFAULT_MODEL

    model_path = registry.resolve(model or DEFAULT_MODEL)
    lora = {}
    for number in range(num_adapters):
        folder = path.parent / "adapters" / Path(model_path).name / f"adapter{number}"
        if not (folder / CONFIG_FILE).is_file():
            write_random_adapter(folder, model_path, rank=ADAPTER_RANK, seed=number)
        lora[f"adapter{number}"] = str(folder)
    mixed = path.with_name(f"{path.stem}-adapters{num_adapters}.jsonl")
    with open(path, encoding="utf-8") as rows, open(mixed, "w", encoding="utf-8") as out:
        for index, line in enumerate(rows):
            out.write(json.dumps({**json.loads(line), "adapter": f"adapter{index % num_adapters}"}) + "\n")
    return mixed, lora
