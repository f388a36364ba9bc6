"""LoRA adapters checked against the base model before any engine starts, and what the job records of them.

An adapter is a PEFT folder: adapter_config.json (its rank `r`, its `target_modules`, the model it was
trained on) and its weights (adapter_model.safetensors, or .bin). What the job gives wrongly stops it here
(exit 2) rather than in vLLM, after the model has loaded: a missing folder, a folder with no config, a config
that is not a LoRA adapter's (not JSON, not an object, another peft_type, a feature vLLM does not run), a rank
vLLM cannot take (or above --max-lora-rank), target modules the base model lacks. Weights that do not match
their config (adapter_weights.py) make the adapter unusable: its rows fail, the others run. An adapter
trained on another base model is a warning only (a fine-tune of a copy or a quantized one is a different name).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from qbatch.errors import SpecError
from qbatch.log import log
from qbatch.models.adapter_weights import WEIGHT_FILES, AdapterShape, ModelLayers, weights_problem
from qbatch.spec import LORA_RANKS, EngineSpec

CONFIG_FILE = "adapter_config.json"
# PEFT's target_modules value for every linear layer: nothing to check by name
ALL_LINEAR = "all-linear"
PEFT_HINT = "pass the folder PEFT's save_pretrained wrote"
# PEFT features that vLLM refuses when it loads the adapter (vllm/lora/peft_helper.py, _validate_features):
# the config key, and the feature's name
UNSUPPORTED_FEATURES = (("use_dora", "DoRA"), ("lora_bias", "LoRA bias"), ("use_qalora", "QALoRA"),
                        ("use_bdlora", "block-diagonal LoRA"), ("alora_invocation_tokens", "Activated LoRA"),
                        ("layer_replication", "layer replication"))
# init_lora_weights values that only set the starting weights (any other changes the base model: PiSSA, LoftQ, ...)
PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


@dataclass(frozen=True)
class Adapter:
    """One adapter as its folder describes it."""

    name: str
    path: str  # as given (--lora NAME=PATH)
    shape: AdapterShape  # its rank and targets, as its config says
    base_model: str | None

    @property
    def where(self) -> str:
        return f"adapter {self.name}: {self.path}"

    @property
    def rank(self) -> int:
        """The largest rank of its modules (rank_pattern may raise some above `r`)."""
        return max([self.shape.rank, *self.shape.rank_pattern.values()])

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The modules it names (empty: a regular expression or all-linear, not checked by name)."""
        return self.shape.target_modules or ()


def read_adapter(name: str, path: str) -> Adapter:
    """The adapter in `path`, or a SpecError saying what the folder or its config lacks."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise SpecError("the adapter folder does not exist", where=f"adapter {name}: {path}",
                        hint="pass --lora NAME=PATH with a PEFT adapter folder")
    config = _read_config(name, path, folder / CONFIG_FILE)
    where = f"adapter {name}: {folder / CONFIG_FILE}"
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise SpecError(f"the adapter is a {peft_type} adapter (peft_type); vLLM runs LoRA adapters only",
                        where=where, hint="pass a LoRA adapter (peft_type LORA)")
    return Adapter(name, path, _shape(config, where), config.get("base_model_name_or_path"))


def _read_config(name: str, path: str, config_path: Path) -> dict[str, Any]:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"the adapter folder has no {CONFIG_FILE}", where=f"adapter {name}: {path}",
                        hint=PEFT_HINT) from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise SpecError(f"{CONFIG_FILE} is not valid JSON: {exc}", where=f"adapter {name}: {config_path}",
                        hint=PEFT_HINT) from None
    except OSError as exc:
        raise SpecError(f"cannot read {CONFIG_FILE}: {exc.strerror or exc}", where=f"adapter {name}: {config_path}",
                        hint="check the file's permissions") from None
    if not isinstance(config, dict):
        raise SpecError(f"{CONFIG_FILE} holds a JSON {_json_kind(config)}, not an object",
                        where=f"adapter {name}: {config_path}", hint=PEFT_HINT)
    return config


def _json_kind(value: Any) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def _shape(config: dict[str, Any], where: str) -> AdapterShape:
    """The config's rank, targets and features, checked as vLLM checks them when it loads the adapter."""
    rank = config.get("r")
    if not _is_count(rank):
        raise SpecError(f"{CONFIG_FILE} has no rank ('r' is {rank!r})", where=where, hint=PEFT_HINT)
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict) or not all(isinstance(k, str) and _is_count(v) for k, v in pattern.items()):
        raise SpecError(f"{CONFIG_FILE}'s rank_pattern must map module names to ranks, got {pattern!r}",
                        where=where, hint=PEFT_HINT)
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise SpecError(f"{CONFIG_FILE} has no lora_alpha (it is {alpha!r})", where=where, hint=PEFT_HINT)
    targets = config.get("target_modules")
    if isinstance(targets, str):  # a regular expression (or all-linear): vLLM goes by the weights' names
        names = None
    elif isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
        names = None if ALL_LINEAR in targets else tuple(targets)
    else:
        raise SpecError(f"{CONFIG_FILE}'s target_modules must be a list of module names or a regular expression, "
                        f"got {targets!r}", where=where, hint=PEFT_HINT)
    feature = _unsupported_feature(config)
    if feature:
        raise SpecError(f"the adapter uses {feature}, which vLLM does not run", where=where,
                        hint="pass a plain LoRA adapter (or merge this one into the model)")
    return AdapterShape(rank, pattern, names)


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _unsupported_feature(config: dict[str, Any]) -> str | None:
    for key, feature in UNSUPPORTED_FEATURES:
        if config.get(key):
            return f"{feature} ({key})"
    if config.get("bias", "none") not in ("none", None):
        return f"bias {config['bias']!r} (bias: vLLM takes none)"
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower() not in PLAIN_INITS:
        return f"init_lora_weights {init!r} (it changes the base model's weights)"
    extra = [m for m in config.get("modules_to_save") or () if m not in ("classifier", "score")]
    if extra:
        return f"modules_to_save {extra} (vLLM takes a classifier or score head only)"
    return None


@dataclass(frozen=True)
class AdapterFacts:
    """An adapter as read and checked against the base model: what plan/resolve.py decides from (which run, vLLM's
    max_lora_rank)."""

    name: str
    path: str  # as given (--lora NAME=PATH)
    rank: int  # its largest
    problem: str | None = None  # what is wrong with its weights (its rows fail: inputs/adapters.py), or None


def read_adapters(spec: EngineSpec, model_path: str) -> tuple[AdapterFacts, ...]:
    """The job's adapters read and checked against the base model (what it gives wrongly stops the job here);
    those whose weights do not match their config are warned of (their rows fail, the others run). An
    embedding job runs the base model: its adapters are not read (plan/resolve.py leaves them out)."""
    if not spec.lora or spec.task == "embed":
        return ()
    adapters = [read_adapter(name, path) for name, path in spec.lora.items()]
    model = ModelLayers.read(model_path)
    for adapter in adapters:
        _check_rank(adapter, spec.max_lora_rank)
        _check_targets(adapter, model)
        _warn_other_base(adapter, spec.model, model_path)
    facts = tuple(AdapterFacts(adapter.name, adapter.path, adapter.rank,
                               weights_problem(Path(adapter.path).expanduser(), adapter.shape, model))
                  for adapter in adapters)
    for fact in facts:
        if fact.problem:
            log.warning("%s; its rows fail (bad_adapter), the others run", unusable_message(fact))
    return facts


def unusable_message(fact: AdapterFacts) -> str:
    return f"adapter {fact.name} ({fact.path}): {fact.problem}"


def _check_rank(adapter: Adapter, max_lora_rank: int | None) -> None:
    limit = max_lora_rank or LORA_RANKS[-1]
    if adapter.rank > limit:
        given = "--max-lora-rank" if max_lora_rank else "vLLM's largest"
        raise SpecError(f"the adapter's rank {adapter.rank} is above {given} ({limit})", where=adapter.where,
                        hint="raise --max-lora-rank" if max_lora_rank and max_lora_rank < LORA_RANKS[-1]
                        else "use an adapter of a smaller rank")


def _check_targets(adapter: Adapter, model: ModelLayers | None) -> None:
    if model is None:  # a hub name not downloaded yet: vLLM checks the weights' modules when it loads the adapter
        return
    missing = [m for m in adapter.target_modules if m.rsplit(".", 1)[-1] not in model.names]
    if missing:
        raise SpecError(f"the adapter's target modules {', '.join(missing)} are not layers of the base model a LoRA "
                        "adapter can change", where=adapter.where,
                        hint=f"use an adapter trained on this --model (its layers: {', '.join(sorted(model.names))})")


def _warn_other_base(adapter: Adapter, model: str, model_path: str) -> None:
    if not adapter.base_model:
        return
    names = {Path(model).name.lower(), Path(model_path).name.lower()}
    if Path(adapter.base_model).name.lower() not in names:
        log.warning("adapter %s was trained on %s, not on %s: its answers may be poor (%s)",
                    adapter.name, adapter.base_model, model, adapter.path)


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

