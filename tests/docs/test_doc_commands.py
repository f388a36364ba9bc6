"""Every `qbatch` command the docs show names a real command and real flags with valid values, the
ones in skipped blocks (GPU-only, hub models) and the benchmark record's included: a renamed flag
fails here, not in a reader's terminal."""

from __future__ import annotations

import re
import shlex

import click
import pytest

from harness import ROOT, check, check_names, commands, expected_exit, qbatch_invocations

from qbatch.cli import cli

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
# a command in running text, as the benchmark record writes them
INLINE = re.compile(rf"`(qbatch (?:{'|'.join(cli.commands)})\b[^`]*)`")


def doc_commands() -> list[tuple[str, str, bool]]:
    """(page:line, command, whole) for every `qbatch` command in a bash block (whole: a command to
    run) or an inline code span (a command's name and flags in running text)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(ROOT)
        for match in FENCE.finditer(text):
            if match.group(1) == "bash":
                line = text.count("\n", 0, match.start()) + 2
                found += [(f"{name}:{line}", command, True) for command in commands(match.group(2))
                          if qbatch_invocations(command) and expected_exit(command) != 2]  # 2: wrong on purpose
        for match in INLINE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{name}:{line}", " ".join(match.group(1).split()), False))
    return found


@pytest.mark.parametrize("where, command, whole", doc_commands(), ids=lambda value: value if isinstance(value, str) and ":" in value else "")
def test_documented_commands_parse(where, command, whole):
    for args in qbatch_invocations(command):
        if not args:
            continue
        try:
            check(args) if whole else check_names(args)
        except click.UsageError as exc:
            pytest.fail(f"{where}: `qbatch {shlex.join(args)}`: {exc.format_message()}")
        except AssertionError as exc:
            pytest.fail(f"{where}: `{command}`: {exc}")


def test_the_command_check_catches_a_wrong_flag():
    with pytest.raises(click.UsageError, match="--max-token"):
        check(["run", "in.jsonl", "--max-token", "5"])
    with pytest.raises(click.UsageError):
        check(["run", "in.jsonl", "--order", "shortest"])
