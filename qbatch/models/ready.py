"""The explicit step before a job is probed: its model made ready to load. A bundled model converted into
qbatch's cache, a hub name's cached copy found when the hub cannot be reached, the weights quantized with
--quantize awq (built once, in qbatch's cache), a 4-bit checkpoint this vLLM cannot run refused. It may write
(caches); probing (plan/probing.py) then only reads."""

from __future__ import annotations

from qbatch.models import registry
from qbatch.spec import JobSpec


def ready_model(spec: JobSpec) -> str:
    """The folder (or hub name) of the model `spec` runs, ready for vLLM to load."""
    engine = spec.engine
    path = registry.resolve(engine.model, engine.revision)
    if engine.quantize:
        from qbatch.models.quantize import ensure_quantized

        return ensure_quantized(path, spec)
    from qbatch.models.quantize import refuse_unrunnable

    refuse_unrunnable(path, spec)
    return path
