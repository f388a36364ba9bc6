"""What a run did: the summary the CLI prints and OUT_DIR/stats.json stores, as a typed record that jobs/
builds and every reader (`qbatch status`, `qbatch report`, a client of the service) loads the same way.

stats.json's keys are the fields' names, in this order (but a dry run's plan: a dry run writes no stats;
the service's answer carries it), then the rates. A key that is no field (the rates, a newer qbatch's)
is left out when read; a field an older qbatch did not write takes its default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qbatch.errors import EXIT_ROW_ERRORS, EXIT_UNUSABLE
from qbatch.output.flags import unusable
from qbatch.output.reading import STATS_HINT, Needed, read_checked
from qbatch.output.record_files import SHAPE, load_record, save_record, shape_of
from qbatch.records import Failure

BASE_MODEL = "(base model)"  # the key of rows without an adapter in Summary.adapters (no adapter name has parentheses)
ADAPTER_COUNTS = ("rows", "prompt_tokens", "completion_tokens")


@dataclass
class Summary:
    """What a run did; the CLI prints it and stats.json stores it."""

    output_dir: str | None = None
    status: str = "unknown"  # running, completed, interrupted; a dry run's: dry-run
    rows_ok: int = 0  # input rows (ids) with results
    samples_ok: int = 0  # their result rows: rows_ok, or more with n > 1 (one a sample)
    rows_failed: int = 0
    rows_skipped: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0  # every sample's
    cached_tokens: int = 0  # of prompt_tokens, those vLLM's prefix cache served (computed once before)
    num_chunks: int = 0
    wall_s: float = 0.0
    setup_s: float = 0.0  # start to engine creation: inputs, tokenizer, fingerprint, resume scan, id pre-scan
    engine_start_s: float = 0.0  # engines started early: from their start, so it overlaps setup_s
    generate_s: float = 0.0
    assemble_s: float = 0.0  # results.parquet / errors.parquet from the parts
    total_ok: int = 0  # ids in results.parquet
    total_samples: int = 0  # rows of results.parquet
    total_failed: int = 0
    failures_by_kind: dict[str, int] = field(default_factory=dict)
    # per chunk, once its last row came back: its rows, tokens, and when (finished_s, from the generation's start)
    chunks: list[dict[str, Any]] = field(default_factory=list, metadata={SHAPE: [
        {"index": Needed(int), "rows": Needed(int), "prompt_tokens": int, "completion_tokens": int,
         "finished_s": (float, None)}]})
    # per part written: its rows and failed rows, when (written_s, from the generation's start), and write_s (jobs/parts.py)
    parts: list[dict[str, Any]] = field(default_factory=list)
    task: str = "generate"  # or "embed": no output tokens, the summary counts input tokens
    engine_choice: str | None = None  # engines per GPU and torch.compile from the job's shape (plan/shape.py)
    plan: str | None = None  # a dry run's plan in words: what the engines would get and why (plan/show.py)
    # jobs with LoRA adapters: per adapter (BASE_MODEL for rows of none) its rows and tokens, as rows_ok and
    # prompt_tokens / completion_tokens count them; None for jobs without adapters
    adapters: dict[str, dict[str, int]] | None = None
    # rows of results.parquet by flag (output/flags.py: no answer, cut, not parsed, empty), once assembled
    flags: dict[str, int] = field(default_factory=dict)
    # what the roofline counts (plan/roofline.py Work): each output token's context, each prompt's own
    decode_context: int = 0
    prefill_context: int = 0
    # on a GPU qbatch has figures for: its least time, the run's share (yardstick.py)
    roofline: dict[str, Any] | None = field(default=None, metadata={SHAPE: (
        {"gpu": Needed(str), "gpus": Needed(int), "bound": Needed(str), "seconds": Needed(float),
         "share": Needed(float)}, None)})
    cost: float | None = None  # the run's wall time on its GPUs at --price-per-gpu-hour
    estimate: dict[str, Any] | None = None  # a dry run's: the generation's time here, on what it rests, its cost

    def count_work(self, completions: list[Any]) -> None:
        """The contexts the roofline counts, of every sample of rows that finished."""
        for c in completions:
            p = c.request.num_prompt_tokens
            self.prefill_context += p * (p - 1) // 2
            for o in (c.num_completion_tokens, *(s.num_completion_tokens for s in c.more_samples)):
                self.decode_context += p * o + o * (o - 1) // 2

    def count_adapters(self, completions: list[Any]) -> None:
        """Rows that finished, counted by their adapter (jobs with adapters only)."""
        if self.adapters is None:
            return
        for c in completions:
            counts = self.adapters.setdefault(c.request.adapter or BASE_MODEL, dict.fromkeys(ADAPTER_COUNTS, 0))
            counts["rows"] += 1
            counts["prompt_tokens"] += c.request.num_prompt_tokens
            counts["completion_tokens"] += c.num_generated_tokens

    def count_failures(self, failures: list[Failure]) -> None:
        self.rows_failed += len(failures)
        for f in failures:
            self.failures_by_kind[f.error] = self.failures_by_kind.get(f.error, 0) + 1

    @property
    def result_rows(self) -> int:
        """Rows of results.parquet: what `flags` counts are of."""
        return self.total_samples or self.total_ok

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.generate_s if self.generate_s else 0.0

    @property
    def output_tok_s(self) -> float:
        return self.completion_tokens / self.generate_s if self.generate_s else 0.0

    def save(self) -> dict[str, Any]:
        """As stats.json holds it: every field but a dry run's plan (which writes no stats), then the rates."""
        stats = save_record(self, nulls=True)
        stats.pop("plan")
        total = self.prompt_tokens + self.completion_tokens
        stats.update(output_tok_s=round(self.output_tok_s, 1),
                     total_tok_s=round(total / self.generate_s, 1) if self.generate_s else 0.0,
                     rows_per_s=round(self.rows_ok / self.generate_s, 2) if self.generate_s else 0.0)
        return stats

    @classmethod
    def read(cls, path: Path) -> Summary | None:
        """stats.json, its fields checked (reading.py); None when there is none."""
        data = read_checked(path, STATS_SHAPE, STATS_HINT)
        return None if data is None else cls.load(data)

    @classmethod
    def load(cls, data: Mapping[str, Any]) -> Summary:
        """A summary as stats.json or the service's answer (wire.py) holds it: keys that are no field (the
        rates, or a newer qbatch's fields) are left out."""
        return load_record(cls, data)


STATS_SHAPE = shape_of(Summary)  # what Summary.read checks, field by field


def exit_code(summary: Summary, *, fail_on_row_errors: bool, max_unusable: float | None = None) -> int:
    """The command's exit status for a run that ended: EXIT_ROW_ERRORS when `--fail-on-row-errors` and
    rows failed (in this run, or recorded by an earlier one); else EXIT_UNUSABLE when more than
    `--max-unusable` of results.parquet's rows have no usable answer; else 0. `qbatch run` and `qbatch
    serve` (for a job handed to it) decide it here, alike."""
    if fail_on_row_errors and (summary.total_failed or summary.rows_failed):
        return EXIT_ROW_ERRORS
    if max_unusable is not None and too_many_unusable(summary, max_unusable):
        return EXIT_UNUSABLE
    return 0


def too_many_unusable(summary: Summary, max_unusable: float) -> bool:
    """Whether more than `max_unusable` (a share) of the results' rows have no usable answer."""
    rows = summary.result_rows
    return rows > 0 and unusable(summary.flags) / rows > max_unusable
