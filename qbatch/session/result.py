"""What a Session call returns: the results and errors as the caller's kind of table, and a summary that reads.

The kind follows the data: a pandas DataFrame gives pandas frames, a pyarrow Table gives pyarrow
tables, a polars frame, a path or a list gives polars frames; `frames="pandas"|"polars"|"arrow"` asks
for one. Printed (a terminal, a notebook), a RunResult and its summary are a few lines, as the CLI's
summary: rows, tokens, throughput, time, and the flagged rows with their fixes.
"""

from __future__ import annotations

import dataclasses
import html
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from qbatch.errors import SpecError
from qbatch.output.summary import Summary
from qbatch.output.flags import flag_lines
from qbatch.session.keywords import for_python
from qbatch.storage.urls import is_remote

Frames = Literal["polars", "pandas", "arrow"]
FRAMES: tuple[str, ...] = ("polars", "pandas", "arrow")


def frames_of(data: Any, frames: str | None) -> str:
    """The kind of tables a call returns: `frames` when given, else the data's own (pandas, arrow; else polars)."""
    if frames is not None:
        if frames not in FRAMES:
            raise SpecError(f"frames must be one of {', '.join(FRAMES)}, got {frames!r}", where="frames=",
                            hint="frames='pandas' for pandas DataFrames, 'arrow' for pyarrow Tables")
        return frames
    module = type(data).__module__.split(".")[0]
    return {"pandas": "pandas", "pyarrow": "arrow"}.get(module, "polars")


def as_frames(frame: Any, frames: str) -> Any:
    """A polars DataFrame as the kind asked for (pandas: a fresh RangeIndex, nested values as Python objects)."""
    if frames == "pandas":
        return frame.to_pandas()
    if frames == "arrow":
        return frame.to_arrow()
    return frame


@dataclass(repr=False)
class RunSummary(Summary):
    """A Summary (what stats.json holds) that prints as a few lines: `print(result.summary)`."""

    @classmethod
    def of(cls, summary: Summary) -> RunSummary:
        return cls(**{f.name: getattr(summary, f.name) for f in dataclasses.fields(Summary)})

    def lines(self) -> list[str]:
        """The CLI summary's main lines: status, rows, tokens, throughput, time, where, and each flag with its fix."""
        embeds = self.task == "embed"
        rows = f"{self.rows_ok:,} rows ok, {self.rows_failed:,} failed"
        if self.failures_by_kind:
            rows += f" ({', '.join(f'{k}: {v:,}' for k, v in sorted(self.failures_by_kind.items()))})"
        if self.rows_skipped:
            rows += f", {self.rows_skipped:,} already done"
        rate = (f"{self.prompt_tok_s:,.1f} input tok/s" if embeds else f"{self.output_tok_s:,.1f} output tok/s")
        lines = [f"qbatch {'embed' if embeds else 'run'} {self.status}: {rows}",
                 f"tokens in / out {self.prompt_tokens:,} / {self.completion_tokens:,}; {rate}",
                 f"generate {self.generate_s:.1f}s of wall {self.wall_s:.1f}s (engine start {self.engine_start_s:.1f}s)"]
        lines += [f"flag: {for_python(line)}" for line in flag_lines(self.flags, self.result_rows)]
        # a bucket's folder, or a local one that is not a call's temporary folder (removed)
        if self.output_dir and (is_remote(self.output_dir) or Path(self.output_dir).is_dir()):
            lines.append(f"output {self.output_dir}")
        return lines

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    __str__ = __repr__

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        head, *rest = self.lines()
        items = "".join(f"<li>{html.escape(line)}</li>" for line in rest)
        return f"<div><b>{html.escape(head)}</b><ul style=\"margin:2px 0\">{items}</ul></div>"


@dataclass(frozen=True, repr=False)
class RunResult:
    """What `Session.run` returns: the CLI's results.parquet and errors.parquet, read into memory.

    `results` has one row per generated row, in input order: id, source, row_index, the input's
    other columns, text, reasoning, finish_reason, prompt_tokens, completion_tokens, cached_tokens
    (and `flag`: null when the answer is usable). `errors` has one row per row that could not be
    generated: id, source, row_index, line, error (a kind such as prompt_too_long), message. Both are
    of the data's kind (a pandas DataFrame in: pandas out; pyarrow: pyarrow; else polars) unless the
    call's `frames=` asked for another. `summary` prints as a few lines; `output_dir` is None for a
    temporary folder.
    """

    results: Any
    errors: Any
    summary: RunSummary
    output_dir: str | None

    def __repr__(self) -> str:
        where = self.output_dir or "a temporary folder, removed"
        return (f"RunResult: {_height(self.results):,} result rows, {_height(self.errors):,} error rows "
                f"({type(self.results).__module__.split('.')[0]}; {where})\n"
                + "\n".join(f"  {line}" for line in self.summary.lines()))

    __str__ = __repr__

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        head = repr(self).splitlines()[0]
        return f"<div>{html.escape(head)}</div>{self.summary._repr_html_()}"


def read_result(summary: Summary, output_dir: str | None, frames: str) -> RunResult:
    """A finished call's RunResult from its folder (a dry run's: no rows), as `frames` tables. `output_dir`:
    the folder as the result names it (an object store's URL, whose local copy `summary` names)."""
    import polars as pl

    from qbatch.output.tables import ERROR_SCHEMA

    if summary.output_dir is None:  # dry_run: nothing generated
        results, errors = pl.DataFrame(), pl.from_arrow(ERROR_SCHEMA.empty_table())
    else:
        folder = Path(summary.output_dir)
        results, errors = pl.read_parquet(folder / "results.parquet"), pl.read_parquet(folder / "errors.parquet")
    if output_dir is not None and is_remote(output_dir):
        summary = dataclasses.replace(summary, output_dir=output_dir)
    return RunResult(as_frames(results, frames), as_frames(errors, frames), RunSummary.of(summary), output_dir)


def _height(frame: Any) -> int:
    return frame.num_rows if hasattr(frame, "num_rows") else len(frame)
