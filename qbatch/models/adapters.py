"""LoRA adapters checked against the base model before any engine starts, and what the job records of them.

An adapter is a PEFT folder: adapter_config.json (its rank `r`, its `target_modules`, the model it was
trained on) and its weights (adapter_model.safetensors, or .bin). A missing folder, a folder with no
config, a rank vLLM cannot take (or above --max-lora-rank) and target modules the base model lacks are
refused here (exit 2) rather than by vLLM, after the model has loaded; an adapter trained on another
base model is a warning only (a fine-tune of a copy or a quantized one is a different name).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from qbatch.errors import SpecError
from qbatch.log import log
from qbatch.spec import LORA_RANKS, EngineSpec

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT's target_modules value for every linear layer: nothing to check by name
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class Adapter:
    """One adapter as its folder describes it."""

    name: str
    path: str  # as given (--lora NAME=PATH)
    rank: int
    target_modules: tuple[str, ...]  # empty: a regular expression or all-linear, not checked by name
    base_model: str | None

    @property
    def where(self) -> str:
        return f"adapter {self.name}: {self.path}"


def read_adapter(name: str, path: str) -> Adapter:
    """The adapter in `path`, or a SpecError saying what the folder lacks."""
    where = f"adapter {name}: {path}"
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise SpecError("the adapter folder does not exist", where=where,
                        hint="pass --lora NAME=PATH with a PEFT adapter folder")
    config_path = folder / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"the adapter folder has no {CONFIG_FILE}", where=where,
                        hint="pass the folder PEFT's save_pretrained wrote") from None
    except (OSError, ValueError) as exc:
        raise SpecError(f"cannot read {CONFIG_FILE}: {exc}", where=where) from None
    if not any((folder / name_).is_file() for name_ in WEIGHT_FILES):
        raise SpecError(f"the adapter folder has no weights ({' or '.join(WEIGHT_FILES)})", where=where,
                        hint="pass the folder PEFT's save_pretrained wrote")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise SpecError(f"{CONFIG_FILE} has no rank ('r' is {rank!r})", where=where)
    targets = config.get("target_modules")
    names = tuple(targets) if isinstance(targets, list) else ()
    return Adapter(name, path, rank, names, config.get("base_model_name_or_path"))


def check_adapters(spec: EngineSpec, model_path: str) -> EngineSpec:
    """The job's adapters read and checked against the base model; the spec with vLLM's max_lora_rank
    set from them when the user left it out (the largest rank, rounded up to one vLLM takes). An embedding
    job runs the base model: its adapters are left out, with a warning."""
    if not spec.lora:
        return spec
    if spec.task == "embed":
        log.warning("an embedding job runs the base model: lora ignored")
        return dataclasses.replace(spec, lora=None, max_loras=None, max_lora_rank=None, max_cpu_loras=None)
    adapters = [read_adapter(name, path) for name, path in spec.lora.items()]
    modules = model_modules(model_path)
    for adapter in adapters:
        _check_rank(adapter, spec.max_lora_rank)
        _check_targets(adapter, modules)
        _warn_other_base(adapter, spec.model, model_path)
    if spec.max_lora_rank is not None:
        return spec
    largest = max(adapter.rank for adapter in adapters)
    return dataclasses.replace(spec, max_lora_rank=next(rank for rank in LORA_RANKS if rank >= largest))


def _check_rank(adapter: Adapter, max_lora_rank: int | None) -> None:
    limit = max_lora_rank or LORA_RANKS[-1]
    if adapter.rank > limit:
        given = "--max-lora-rank" if max_lora_rank else "vLLM's largest"
        raise SpecError(f"the adapter's rank {adapter.rank} is above {given} ({limit})", where=adapter.where,
                        hint="raise --max-lora-rank" if max_lora_rank and max_lora_rank < LORA_RANKS[-1]
                        else "use an adapter of a smaller rank")


def _check_targets(adapter: Adapter, modules: set[str] | None) -> None:
    if modules is None:  # a hub name not downloaded yet: vLLM checks them when it loads the adapter
        return
    missing = [m for m in adapter.target_modules if m != ALL_LINEAR and m.rsplit(".", 1)[-1] not in modules]
    if missing:
        raise SpecError(f"the adapter's target modules {', '.join(missing)} are not in the base model",
                        where=adapter.where, hint="use an adapter trained on this --model")


def _warn_other_base(adapter: Adapter, model: str, model_path: str) -> None:
    if not adapter.base_model:
        return
    names = {Path(model).name.lower(), Path(model_path).name.lower()}
    if Path(adapter.base_model).name.lower() not in names:
        log.warning("adapter %s was trained on %s, not on %s: its answers may be poor (%s)",
                    adapter.name, adapter.base_model, model, adapter.path)


def model_modules(model_path: str) -> set[str] | None:
    """The names of the base model's modules (each part of its weights' names: q_proj, layers, ...), read
    from its safetensors headers; None when the folder has none (a hub name, .bin weights)."""
    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if not files:
        return None
    modules: set[str] = set()
    for file in files:
        for key in tensor_shapes(file):
            modules.update(key.split("."))
    return modules


def tensor_shapes(path: Path) -> dict[str, list[int]]:
    """A safetensors file's tensors' shapes by name, from its header (a little-endian length, then JSON)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {key: value["shape"] for key, value in header.items() if key != "__metadata__"}


def adapters_identity(lora: dict[str, str] | None) -> dict[str, str] | None:
    """Each adapter's content (its config and weights, SHA-256) by name: what the fingerprint records,
    so a changed adapter file is a changed setting and a moved folder is not."""
    if not lora:
        return None
    return {name: _folder_hash(Path(path).expanduser()) for name, path in sorted(lora.items())}


def _folder_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, *WEIGHT_FILES):
        path = folder / name
        if not path.is_file():
            continue
        digest.update(name.encode() + b"\0")
        with open(path, "rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()

