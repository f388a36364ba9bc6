"""The plan a run recorded in manifest.json (`plan`, written by qbatch/plan/record.py) in words: a few lines
for `qbatch status`, every setting with its reason for `qbatch status --plan` and the report. A manifest of
a run older than the record has none: None."""

from __future__ import annotations

from typing import Any


def summary_lines(record: dict[str, Any]) -> list[str]:
    """A recorded plan in a few lines (`qbatch status`): the engines, where, and the settings that decide speed."""
    args, placement = record.get("llm_args") or {}, record.get("placement") or {}
    where = record.get("platform", "?") if record.get("platform") != "cuda" else \
        f"GPU {','.join(placement.get('devices') or [])}"
    lines = [f"{placement.get('engines', 1)} {record.get('backend', '?')} engine(s) on {where}"
             + (f", {placement['engines_per_gpu']} per GPU" if placement.get("engines_per_gpu", 1) > 1 else "")
             + (" under CUDA MPS" if placement.get("mps") else "")]
    shown = [f"{name}={_short((args.get(name) or {}).get('value'))}" for name in
             ("max_model_len", "max_num_seqs", "gpu_memory_utilization", "kv_cache_memory_bytes", "enforce_eager")
             if name in args]
    if shown:
        lines.append(" ".join(shown))
    if record.get("chosen_from_shape"):
        lines.append(f"chosen from the job's shape: {record['chosen_from_shape']}")
    return lines


def full_lines(record: dict[str, Any]) -> list[str]:
    """Every recorded setting with its reason, one a line (`qbatch status --plan`, the report)."""
    lines = [f"LLM {name} = {_short(s.get('value'))}  # {s.get('reason') or ''}".rstrip(" #")
             for name, s in (record.get("llm_args") or {}).items()]
    for env in record.get("env") or []:
        value = env.get("value") if env.get("value") is not None else "(set at the engines' start)"
        rank = "" if env.get("rank") is None else f" (engine {env['rank']})"
        lines.append(f"env {env.get('name')}{rank} = {value}  # {env.get('reason') or ''}".rstrip(" #"))
    lines += [f"qbatch {name} = {_short(s.get('value'))}  # {s.get('reason') or ''}".rstrip(" #")
              for name, s in (record.get("decisions") or {}).items()]
    return lines


def _short(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list) and len(value) > 8:
        return f"[{value[0]}, ..., {value[-1]}] ({len(value)})"
    return str(value)
