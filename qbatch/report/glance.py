"""The numbers at the head of `qbatch report`: what a deployment is judged by, for one run.

Someone who judges a deployment by nvidia-smi looks first at how busy the GPUs were while the job
generated, how many tokens a second it got out of them (and out of each GPU), the power they drew,
the memory they held, and where the wall time went. Each comes from the telemetry of the run (its
samples are its generation: data.py) or from stats.json, the last completed run's numbers.
"""

from __future__ import annotations

from typing import Any

from qbatch.output.manifest import Manifest
from qbatch.output.summary import Summary
from qbatch.report.timeline import Timeline, increments


def run_numbers(timeline: Timeline, run: dict[str, Any], *, embeds: bool) -> dict[str, Any]:
    """One run's generation, from its samples: tok/s (the engines' counters: output tokens, or input
    tokens for embeddings), mean GPU utilization (over its GPUs and time), mean power per GPU and the
    energy of all GPUs, peak GPU memory, mean CPU % and peak RSS. None for what was not recorded."""
    import polars as pl

    seconds = run["seconds"] or 0.0
    out: dict[str, Any] = {"tok_s": None, "gpus": 0, "gpu_util_pct": None, "cpu_pct": None}
    engine = timeline.rows("engine", run=run["index"])
    if engine is not None and seconds > 0:
        tokens = increments(engine).get_column("prompt_tokens" if embeds else "generation_tokens").sum()
        out["tok_s"] = round(tokens / seconds, 1)
    gpu = timeline.rows("gpu", run=run["index"])
    if gpu is not None:
        per_gpu = gpu.group_by("device").agg(
            pl.col("gpu_util_pct").mean(), pl.col("gpu_power_w").mean(), pl.col("gpu_mem_used_bytes").max(),
            pl.col("gpu_mem_total_bytes").max()).sort("device")
        out["gpus"] = per_gpu.height
        out["gpu_util_pct"] = _round(per_gpu["gpu_util_pct"].mean(), 1)
        out["gpu_util_by_gpu"] = {str(d): _round(u, 1) for d, u in zip(per_gpu["device"], per_gpu["gpu_util_pct"])}
        power = per_gpu["gpu_power_w"].drop_nulls()
        if power.len():
            out["gpu_power_w"] = _round(power.mean(), 1)
            out["gpu_energy_wh"] = _round(power.sum() * seconds / 3600, 2)
        out["gpu_mem_peak_gib"] = _round(_max_or_none(per_gpu["gpu_mem_used_bytes"]), 1, 1 / 2**30)
        out["gpu_mem_total_gib"] = _round(_max_or_none(per_gpu["gpu_mem_total_bytes"]), 1, 1 / 2**30)
    host_rows = timeline.rows("host", run=run["index"])
    if host_rows is not None:
        out["cpu_pct"] = _round(host_rows["cpu_pct"].mean(), 0)
        out["rss_peak_gib"] = _round(_max_or_none(host_rows["rss_bytes"]), 1, 1 / 2**30)
    return out


def glance(manifest: Manifest, stats: Summary | None, timeline: Timeline) -> dict[str, Any]:
    """What someone who judges a deployment by nvidia-smi looks for first, for one run (the last that
    generated): mean GPU (or CPU) utilization while it generated, output tok/s (per GPU too), GPU
    power and energy, peak GPU memory; and the phase split of stats.json (the last completed run).

    tok/s is stats.json's (what the run printed) when stats.json is that run's, else the engines'
    counters over its samples (`tok_s_source` says which).
    """
    embeds = manifest.task == "embed"
    run = timeline.last_run()
    out: dict[str, Any] = {"run": None, "runs": len(timeline.runs), "tokens_of": "input" if embeds else "output",
                           "generate_s": None, "tok_s": None, "tok_s_source": None, "gpus": 0}
    if run is not None:
        out.update(run_numbers(timeline, run, embeds=embeds), run=run["label"], generate_s=run["seconds"])
        out["tok_s_source"] = "telemetry" if out["tok_s"] is not None else None
    if stats is not None and _stats_are_of(stats, manifest, run):
        tokens = stats.prompt_tokens if embeds else stats.completion_tokens
        out.update(tok_s=round(tokens / stats.generate_s, 1), tok_s_source="stats.json",
                   generate_s=round(stats.generate_s, 1))
    if out["tok_s"] is not None and out["gpus"]:
        out["tok_s_per_gpu"] = round(out["tok_s"] / out["gpus"], 1)
    out["phases"] = phase_split(stats)
    return out


def _stats_are_of(stats: Summary, manifest: Manifest, run: dict[str, Any] | None) -> bool:
    """Whether stats.json (written when a run completes) is this run's: the folder's last run, which completed
    and generated. A run that found nothing to do writes a stats.json without generation; one that stopped
    writes none, leaving an earlier run's."""
    if not stats.generate_s:
        return False
    if run is None:  # no telemetry: stats.json is all there is
        return manifest.status == "completed"
    return bool(run["is_last"] and run["status"] == "completed")


def _round(value: Any, digits: int, scale: float = 1.0) -> float | None:
    return None if value is None else round(float(value) * scale, digits)


def _max_or_none(series: Any) -> Any:
    series = series.drop_nulls()
    return series.max() if series.len() else None


def phase_split(stats: Summary | None) -> list[dict[str, Any]] | None:
    """The last completed run's wall time split into what it waited on, in order: setup (inputs, tokenizer,
    the pre-scan), the engine's start beyond the setup (engines start early, beside the setup: only the
    wait left after it counts), generation, and assembly. The parts add up to the wall time. None when
    that run generated nothing (a rerun that found every row done)."""
    if stats is None or not stats.wall_s or not stats.generate_s:
        return None
    wall, setup, generate, assemble = (float(s) for s in (stats.wall_s, stats.setup_s, stats.generate_s,
                                                             stats.assemble_s))
    waited = max(0.0, min(float(stats.engine_start_s), wall - setup - generate - assemble))
    parts = [("setup", setup), ("engine start", waited), ("generate", generate), ("assembly", assemble)]
    other = wall - sum(seconds for _, seconds in parts)
    if other > 0.05 * wall:  # time the phases above do not cover (writing stats, the run's own overhead)
        parts.append(("other", other))
    return [{"name": name, "seconds": round(seconds, 2), "share": round(seconds / wall, 4)}
            for name, seconds in parts if seconds > 0] + [{"name": "wall", "seconds": round(wall, 2), "share": 1.0}]
