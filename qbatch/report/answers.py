"""The report's answers: how many rows each flag holds, with its fix, and example rows to read.

A result row's `flag` (output/flags.py) says whether its answer is usable: null, or in_reasoning,
not_parsed, empty, cut. Folders written before the column existed have none; their flags are derived
from the columns they have (finish_reason, reasoning, parse_error) by the same rules, in the same order.
The page shows the first rows as they came out, then a few rows of each flag, answers shortened: a
million-row run still gives a few rows.
"""

from __future__ import annotations

import html
from typing import Any

from qbatch.output.flags import CUT, EMPTY, FLAGS, IN_REASONING, NOT_PARSED, UNUSABLE, flag_lines

NUM_FIRST = 3  # the first rows, whatever their flag
NUM_PER_FLAG = 3
SHOWN_CHARS = 300  # of an answer (its start) or of a reasoning that never closed (its end: where it was cut)
EXAMPLE_COLUMNS = ("id", "flag", "finish_reason", "completion_tokens", "text", "reasoning", "parse_error")


def summarize(results: Any) -> dict[str, Any]:
    """Counts by flag and example rows of a results LazyFrame (results.parquet or the parts)."""
    import polars as pl

    names = results.collect_schema().names()
    frame = results.with_columns(_flag(names).alias("flag"), *(pl.lit(None, pl.String).alias(c) for c in
                                                               ("text", "reasoning", "parse_error") if c not in names))
    counts = frame.group_by("flag").len().collect()
    flags = {str(f): int(n) for f, n in counts.iter_rows() if f is not None}
    shown = [c for c in EXAMPLE_COLUMNS if c in names or c in ("flag", "text", "reasoning", "parse_error")]
    first = frame.head(NUM_FIRST).select(shown).collect().to_dicts()
    examples = {flag: frame.filter(pl.col("flag") == flag).head(NUM_PER_FLAG).select(shown).collect().to_dicts()
                for flag in FLAGS if flags.get(flag)}
    return {"rows": int(counts["len"].sum()), "flags": flags, "first": [_short(r) for r in first],
            "examples": {flag: [_short(r) for r in rows] for flag, rows in examples.items()},
            "derived": "flag" not in names}


def _flag(names: list[str]) -> Any:
    """The `flag` column, or the same rules on the columns an older folder has: a row that ended inside its
    reasoning has reasoning, no answer and finish_reason length; then a parse error, an empty answer, a cut."""
    import polars as pl

    if "flag" in names:
        return pl.col("flag")
    cut = pl.col("finish_reason") == "length" if "finish_reason" in names else pl.lit(False)
    answer = pl.col("text").fill_null("").str.strip_chars() if "text" in names else pl.lit("")
    rules = []
    if "reasoning" in names:
        rules.append((pl.col("reasoning").is_not_null() & (answer == "") & cut, IN_REASONING))
    if "parse_error" in names:
        rules.append((pl.col("parse_error").is_not_null(), NOT_PARSED))
    if "text" in names:
        rules.append((answer == "", EMPTY))
    rules.append((cut, CUT))
    expr = pl.lit(None, pl.String)
    for condition, flag in reversed(rules):  # the first rule that holds wins, as output/flags.row_flag
        expr = pl.when(condition.fill_null(False)).then(pl.lit(flag)).otherwise(expr)
    return expr


def _short(row: dict[str, Any]) -> dict[str, Any]:
    """A row to show: its answer's start; a reasoning that never closed, its end (where it was cut)."""
    text, reasoning = row.get("text") or "", row.get("reasoning") or ""
    row["text"] = text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + " …"
    row["reasoning"] = reasoning if len(reasoning) <= SHOWN_CHARS else "… " + reasoning[-SHOWN_CHARS:]
    return row


# -- the page ------------------------------------------------------------------
def answers_section(info: dict[str, Any] | None) -> str:
    """Flags with their counts and fixes, the first rows, and examples of each flag."""
    if info is None:
        return '<section><h2>Answers</h2><p class="missing" data-answers="none">not recorded: no results yet</p></section>'
    flags, rows = info["flags"], info["rows"]
    lines = flag_lines(flags, rows)
    order = [f for f in FLAGS if flags.get(f)]
    if lines:
        items = "".join(f'<li class="flag-line{" unusable" if f in UNUSABLE else ""}" data-flag="{f}">'
                        f"{html.escape(line)}</li>" for f, line in zip(order, lines, strict=True))
        summary = f'<ul class="flags">{items}</ul>'
    else:
        summary = f'<p data-flag="none">All {rows:,} answers usable: none cut, empty, unparsed or inside their reasoning.</p>'
    derived = ('<p class="note">flags derived from finish_reason, reasoning and parse_error (results written '
               'before the flag column)</p>' if info.get("derived") else "")
    blocks = [_examples("The first rows", "first", info["first"])]
    blocks += [_examples(f"Flagged {flag} ({flags[flag]:,} row{'s' if flags[flag] > 1 else ''})", flag, info["examples"][flag]) for flag in order]
    return (f'<section class="answers"><h2>Answers</h2><p class="note">each result row\'s flag (null: usable), '
            f'with what fixes it; then example rows</p>{summary}{derived}{"".join(blocks)}</section>')


def _examples(title: str, key: str, rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    body = "".join(
        f'<tr><td><code>{html.escape(str(r["id"]))}</code></td><td>{html.escape(r.get("flag") or "")}</td>'
        f'<td>{html.escape(str(r.get("finish_reason") or ""))}</td><td>{r.get("completion_tokens") or 0:,}</td>'
        f'<td class="answer">{_answer(r)}</td></tr>' for r in rows)
    return (f'<h3>{html.escape(title)}</h3><table class="examples" data-examples="{key}"><tr><th>id</th><th>flag</th>'
            f'<th>finish</th><th>output tokens</th><th>answer</th></tr>{body}</table>')


def _answer(row: dict[str, Any]) -> str:
    parts = []
    if row.get("flag") == IN_REASONING and row.get("reasoning"):
        parts.append(f'<div class="reasoning">reasoning, cut: {html.escape(row["reasoning"])}</div>')
    parts.append(html.escape(row["text"]) if row["text"].strip() else '<i class="missing">(no answer)</i>')
    if row.get("parse_error"):
        parts.append(f'<div class="parse-error">parse_error: {html.escape(str(row["parse_error"]))}</div>')
    return "".join(parts)
