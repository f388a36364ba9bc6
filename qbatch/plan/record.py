"""A Plan as the run records it: manifest.json's `plan` (jobs/manifest.py), read back by `qbatch status` and
the report. JSON only, its keys stable: what vLLM got (every LLM(...) argument and environment variable
qbatch set, each with why), where the engines ran, and qbatch's own decisions. No secrets: a value whose
name says it is one is left out."""

from __future__ import annotations

import re
from typing import Any

from qbatch.plan.resolve import Plan

RECORD_VERSION = 1
SECRET = re.compile(r"(^|_)(token|secret|password|api_key|key)$", re.IGNORECASE)
HIDDEN = "<hidden>"


def plan_record(plan: Plan) -> dict[str, Any]:
    """The plan's record: {version, model, model_path, backend, task, platform, llm_args, env, placement,
    decisions, chosen_from_shape}; each setting as {value, reason}."""
    engine = plan.engine
    return {
        "version": RECORD_VERSION,
        "model": engine.model,
        "model_path": engine.model_path,
        "backend": engine.backend,
        "task": engine.task,
        "platform": engine.platform,
        "llm_args": {name: _setting(name, value, engine.reason(name)) for name, value in engine.kwargs().items()},
        "env": [{"name": s.name, "value": _safe(s.name, s.value), "reason": s.reason, "rank": s.rank}
                for s in plan.env],
        "placement": {"devices": list(engine.devices), "engines_per_gpu": engine.engines_per_gpu,
                      "data_parallel_size": engine.data_parallel_size, "engines": engine.engine_count(),
                      "mps": engine.mps, "start_together": engine.start_together},
        "decisions": {d.name: _setting(d.name, d.value, d.reason) for d in plan.decisions},
        "chosen_from_shape": plan.choice.reason if plan.choice else None,
    }


def _setting(name: str, value: Any, reason: str | None) -> dict[str, Any]:
    return {"value": _safe(name, value), "reason": reason}


def _safe(name: str, value: Any) -> Any:
    return HIDDEN if value is not None and SECRET.search(name) else value
