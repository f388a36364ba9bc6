"""What the CLI prints on stdout: the end-of-run summary and `qbatch status`, as aligned tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from qbatch._fs import is_url
from qbatch.output.summary import Summary
from qbatch.output.flags import flag_lines
from qbatch.output.recorded_plan import full_lines, summary_lines


def print_summary(summary: Summary) -> None:
    if summary.status == "dry-run":
        _table("dry run (no model loaded)", [
            ("rows valid", f"{summary.rows_ok:,}"),
            ("rows failing validation", f"{summary.rows_failed:,}" + _kinds(summary.failures_by_kind)),
            ("prompt tokens", f"{summary.prompt_tokens:,}"),
            ("chunks planned", f"{summary.num_chunks:,}" + _chunk_range(summary.chunks)),
            ("time", f"{summary.wall_s:.1f}s"),
            *_estimate_rows(summary.estimate),
        ])
        if summary.plan:
            click.echo("plan (what the engines would get, and why)")
            for line in summary.plan.splitlines():
                click.echo(f"  {line}")
        return
    embeds = summary.task == "embed"
    _table(f"qbatch {'embed' if embeds else 'run'} {summary.status}", [
        ("rows ok (this run)", f"{summary.rows_ok:,}" + _samples(summary.samples_ok, summary.rows_ok)),
        ("rows failed (this run)", f"{summary.rows_failed:,}" + _kinds(summary.failures_by_kind)),
        ("rows already done", f"{summary.rows_skipped:,}"),
        ("tokens in / out", f"{summary.prompt_tokens:,} / {summary.completion_tokens:,}" + _cached(summary)),
        ("input tok/s", f"{summary.prompt_tok_s:,.1f}") if embeds else ("output tok/s", f"{summary.output_tok_s:,.1f}"),
        ("engine start / generate / wall", f"{summary.engine_start_s:.1f}s / {summary.generate_s:.1f}s / {summary.wall_s:.1f}s"),
        ("of the rest: setup / assemble", f"{summary.setup_s:.1f}s / {summary.assemble_s:.1f}s"),
        ("results", f"{_in_folder(summary.output_dir, 'results.parquet')} ({summary.total_ok:,} rows"
                    f"{_samples(summary.total_samples, summary.total_ok)})"),
        ("errors", f"{_in_folder(summary.output_dir, 'errors.parquet')} ({summary.total_failed:,} rows)"),
        *_adapter_lines(summary.adapters),
        *_flag_rows(summary),
        *_yardstick_rows(summary),
    ])
    for line in flag_lines(summary.flags, summary.result_rows):
        click.echo(f"  {line}")


def _yardstick_rows(summary: Summary) -> list[tuple[str, str]]:
    """How close the run came to its GPU's roofline (jobs/yardstick.py), and its cost at the price given."""
    rows = []
    if summary.roofline:
        rows.append(("of the GPU's roofline", _roofline(summary.roofline)))
    if summary.cost is not None:
        rows.append(("cost", f"{summary.cost:,.4f} (wall time at --price-per-gpu-hour)"))
    return rows


def _roofline(line: dict[str, Any]) -> str:
    """A run's share of its GPU's roofline, as stats.json records it (jobs/yardstick.py)."""
    return (f"{line['share']:.0%} ({line['gpus']}x {line['gpu']}, {line['bound']}-bound: {line['seconds']:.1f}s at best "
            "for this work)")


def _estimate_rows(estimate: dict[str, Any] | None) -> list[tuple[str, str]]:
    """A dry run's estimate of the generation's time here, what it rests on, and its cost."""
    if not estimate:
        return []
    seconds = estimate["seconds"]
    rows = [("estimated generate time", "unknown" if seconds is None else _duration(seconds)),
            ("estimate based on", estimate["basis"])]
    if estimate.get("cost") is not None:
        rows.append(("estimated cost", f"{estimate['cost']:,.4f} (at --price-per-gpu-hour)"))
    return rows


def _flag_rows(summary: Summary) -> list[tuple[str, str]]:
    """The results' rows a user must not miss (output/flags.py), when there are any: said again below with their fixes."""
    if not any(summary.flags.values()):
        return []
    return [("answers to check", f"{sum(summary.flags.values()):,} of {summary.result_rows:,} rows (" +
             ", ".join(f"{n:,} {flag}" for flag, n in summary.flags.items() if n) + ")")]


def _adapter_lines(adapters: dict[str, dict[str, int]] | None) -> list[tuple[str, str]]:
    """Rows and tokens of this run per LoRA adapter (jobs with adapters)."""
    return [(f"adapter {name}", f"{counts['rows']:,} rows, tokens in / out {counts['prompt_tokens']:,} / "
                                f"{counts['completion_tokens']:,}") for name, counts in sorted((adapters or {}).items())]


def _cached(summary: Summary) -> str:
    """The share of input tokens vLLM's prefix cache served: what shared prefixes saved."""
    if not summary.cached_tokens or not summary.prompt_tokens:
        return ""
    return f" ({summary.cached_tokens / summary.prompt_tokens:.0%} of input from the prefix cache)"


def _table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(label) for label, _ in rows)
    click.echo(title)
    for label, value in rows:
        click.echo(f"  {label:<{width}}  {value}")


def _samples(num_samples: int, num_rows: int) -> str:
    """", 12 samples" when rows have several (n > 1), else nothing: one result row a sample."""
    return f", {num_samples:,} samples" if num_samples != num_rows else ""


def _kinds(kinds: dict[str, int]) -> str:
    return f" ({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))})" if kinds else ""


def _chunk_range(chunks: list[dict[str, Any]]) -> str:
    if not chunks:
        return ""
    rows = [c["rows"] for c in chunks]
    return f" ({min(rows)}-{max(rows)} rows each)"


def _rate(value: float | None, unit: str) -> str:
    return f"? {unit}" if value is None else f"{value:,.1f} {unit}"


def _duration(seconds: float) -> str:
    """12s, 4m 05s, 3h 02m."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def print_status(info: dict[str, Any], *, full_plan: bool = False) -> None:
    remaining = "unknown" if info["rows_remaining"] is None else f"{info['rows_remaining']:,}"
    last = info["last_run"]
    rows = [
        ("status", info["status"] + (f" ({info['running']})" if info["running"] else "")),
        ("model", str(info["model"])),
        ("rows done", f"{info['rows_done']:,}"),
        ("rows failed", f"{info['rows_failed']:,}"),
        ("rows remaining", remaining),
        ("parts", str(info["parts"])),
    ]
    rows += _live_lines(info.get("live"))
    if info["merged_from"]:
        rows.append(("merged from", f"{len(info['merged_from'])} shards"))
    if last.get("output_tok_s") is not None:
        rows.append(("last run", f"{last['rows_ok']:,} rows, {last['completion_tokens']:,} output tokens, "
                                 f"{last['output_tok_s']:,.1f} output tok/s"))
    roofline = info.get("roofline")
    if roofline:
        rows.append(("of the GPU's roofline", _roofline(roofline)))
    recorded = info.get("plan")  # the engines' plan, as the run recorded it (none before qbatch recorded it)
    if recorded:
        rows += [("engines" if i == 0 else "", line) for i, line in enumerate(summary_lines(recorded))]
    if info["hint"]:
        rows.append(("hint", info["hint"]))
    _table(f"qbatch status {info['output_dir']}", rows)
    if info.get("flags") and info.get("result_rows"):
        for line in flag_lines(info["flags"], info["result_rows"]):  # results.parquet's rows with no usable answer
            click.echo(f"  {line}")
    if full_plan:
        click.echo("plan:" if recorded else "plan: not recorded (the run was of a qbatch that did not record it)")
        for line in full_lines(recorded or {}):
            click.echo(f"  {line}")


def _live_lines(live: dict[str, Any] | None) -> list[tuple[str, str]]:
    """A live run's phase; once it generates (or when it did not say), its rates, ETA and GPUs now.
    Before it generates there is no rate to tell: the phase says what it waits for."""
    if not live:
        return []
    phase = live.get("phase")
    rows = [("phase", phase)] if phase else []
    if phase and not phase.startswith("generating"):
        return rows
    rows.append(("now", f"{_rate(live['rows_s'], 'rows/s')}, {_rate(live['output_tok_s'], 'output tok/s')}"
                        f" (from {live['rates_from']})"))
    rows.append(("eta", "unknown" if live["eta_s"] is None else _duration(live["eta_s"])))
    if live["gpu_util_pct"]:
        rows.append(("gpu utilization", ", ".join(f"GPU {d}: {u:.0f}%" for d, u in live["gpu_util_pct"].items()
                                                  if u is not None)))
    return rows


def _in_folder(output_dir: str | None, name: str) -> str:
    """A file of the output folder as the user names it: a path, or in an object store a URL (not `s3:/b/x`)."""
    if output_dir and is_url(output_dir):
        return f"{output_dir.rstrip('/')}/{name}"
    return str(Path(output_dir or ".") / name)
