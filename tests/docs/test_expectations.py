"""The quick start's "what to expect" table says only what the benchmark notebook measured: every figure of
a cell appears in the notebook's section that the cell cites, that section carries the cell's date, a
"rows a minute" figure is its rows over its seconds, and a cell without a citation says "not measured".
The performance page's headline table likewise: each row dated, each figure in the notebook.
"""

from __future__ import annotations

import re

import pytest

from harness import ROOT

QUICKSTART = ROOT / "docs" / "quickstart.md"
NOTEBOOK = ROOT / "docs" / "benchmarks.md"
# "(2026-12-04, [session 50](benchmarks.md#session-50))": a figure's date and the section it comes from
CITATION = re.compile(r"\((\d{4}-\d{2}-\d{2}), \[[^\]]+\]\(benchmarks\.md#([\w-]+)\)\)")
# "~4,158 rows a minute (4,096 rows in 59.1 s": a figure derived from two measured ones
RATE = re.compile(r"~([\d,]+) rows a minute \(([\d,]+) rows in ([\d.]+) s")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
HEADING = re.compile(r"^(#+) .*?\{ #([\w-]+) \}$", re.M)


def numbers(text: str) -> set[str]:
    return {n.replace(",", "").rstrip(".") for n in NUMBER.findall(text)}


def sections() -> dict[str, str]:
    """The notebook's sections that have an explicit id, each to the next heading of its level or above."""
    text = NOTEBOOK.read_text()
    found = {}
    for match in HEADING.finditer(text):
        level = len(match.group(1))
        end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, match.end())
        found[match.group(2)] = text[match.start():end.start() if end else len(text)]
    return found


def table_cells() -> list[tuple[str, str]]:
    """(row, cell) for each figure cell of the table under "### What to expect"."""
    text = QUICKSTART.read_text()
    part = text[text.index("### What to expect"):]
    rows = [line for line in part.splitlines() if line.startswith("|")]
    assert len(rows) >= 6, "the what-to-expect table is missing or short"
    cells = []
    for line in rows[2:]:  # the header and its rule
        name, *figures = [cell.strip() for cell in line.strip("|").split("|")]
        cells += [(name, cell) for cell in figures]
    return cells


@pytest.mark.parametrize("row, cell", table_cells(), ids=lambda value: value[:40])
def test_each_figure_is_in_the_section_it_cites(row, cell):
    notebook = sections()
    citations = list(CITATION.finditer(cell))
    if not citations:
        assert cell == "not measured", f"{row}: a figure without its date and section: {cell!r}"
        return
    start = 0
    for citation in citations:
        date, anchor = citation.groups()
        figures = cell[start:citation.start()]
        start = citation.end()
        assert anchor in notebook, f"{row}: no section {{ #{anchor} }} in docs/benchmarks.md"
        section = notebook[anchor]
        assert date in section, f"{row}: section #{anchor} has no date {date}"
        for rate in RATE.finditer(figures):
            said, rows, seconds = (float(value.replace(",", "")) for value in rate.groups())
            assert said == round(rows * 60 / seconds), f"{row}: {rate.group(0)!r} is not its rows over its time"
            figures = figures.replace(rate.group(0).split(" (")[0], "")
        missing = numbers(figures) - numbers(section)
        assert not missing, f"{row}: {sorted(missing)} not in section #{anchor} of docs/benchmarks.md"


def test_the_check_catches_a_figure_the_notebook_lacks():
    section = sections()["session-50"]
    assert "35.3" in numbers(section) and "34.2" not in numbers(section)


def test_the_performance_headline_says_only_what_the_notebook_measured():
    """Each row of docs/performance.md's headline table has its date, and each of its figures is in the notebook."""
    text = (ROOT / "docs" / "performance.md").read_text()
    part = text[text.index("## The headline"):text.index("## Where the rest is")]
    rows = [line for line in part.splitlines() if line.startswith("|")][2:]
    notebook = numbers(NOTEBOOK.read_text())
    assert len(rows) >= 10
    for line in rows:
        assert re.search(r"\d{4}-\d{2}-\d{2}", line), f"a headline row without its date: {line[:80]}"
        cited = re.sub(r"\(benchmarks\.md#[\w-]+\)|\d{4}-\d{2}-\d{2}|issue #\d+|session \d+", "", line)
        missing = numbers(cited) - notebook
        assert not missing, f"{sorted(missing)} not in docs/benchmarks.md: {line[:80]}"
