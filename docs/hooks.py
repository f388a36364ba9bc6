"""MkDocs hooks: reference pages generated from the code, so they cannot drift from it.

- `::: mkdocs-click` blocks become each command's help, usage and options (mkdocs-click's own
  rendering, in its plain style: the options as `--help` prints them), with the help's
  examples kept as text blocks.
- `<!-- generated: job-file-keys -->` becomes the table of every job-file key: its section, type,
  default, whether it enters the fingerprint, its flag and help, read from the settings' declarations
  in qbatch/spec.py (the flags are generated from them too).

tests/docs/test_reference.py builds the site and checks both.
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from typing import Any

MARKER = "<!-- generated: job-file-keys -->"


def on_page_markdown(markdown: str, **_: Any) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, job_file_keys_table())
    if "::: mkdocs-click" in markdown:
        markdown = command_docs(markdown)
    return markdown


def command_docs(markdown: str) -> str:
    """The page with its `::: mkdocs-click` blocks replaced by the commands' docs."""
    from mkdocs_click._extension import replace_command_docs
    from mkdocs_click._processing import replace_blocks

    def replace(**options: Any) -> list[str]:
        return _verbatim_paragraphs(replace_command_docs(has_attr_list=True, **options))

    return "\n".join(replace_blocks(markdown.splitlines(), title="mkdocs-click", replace=replace))


def _verbatim_paragraphs(lines: Any) -> list[str]:
    """A help paragraph of indented lines under a heading ("Examples:", kept as written by Click's
    `\\b`) becomes the heading and a text block; the rest stays as mkdocs-click wrote it."""
    out: list[str] = []
    paragraph: list[str] = []
    for line in [*lines, ""]:
        if line.strip():
            paragraph.append(line)
            continue
        if len(paragraph) > 1 and paragraph[0].endswith(":") and all(p[:1].isspace() for p in paragraph[1:]):
            out += [f"**{paragraph[0]}**", "", "```text", *textwrap.dedent("\n".join(paragraph[1:])).splitlines(), "```"]
        else:
            out += paragraph
        out.append("")
        paragraph = []
    return out


def job_file_keys_table() -> str:
    """One row per job-file key, in the spec's order, grouped by section."""
    from qbatch.spec import SECTIONS, declared

    helps = _flag_helps()
    lines = ["| key | section | type | default | changes results | what it sets |",
             "|---|---|---|---|---|---|"]
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            flag, text = helps.get(field.name, (None, declared(field).help))  # inputs, task: no flag
            lines.append("| `{}` | {} | {} | {} | {} | {} |".format(
                field.name, section, _type_name(hints[field.name]), _default(field),
                "yes" if declared(field).results else "",
                _cell(f"`{flag}`: {text}" if flag else text)))
    return "\n".join(lines)


def _flag_helps() -> dict[str, tuple[str, str]]:
    """Each setting's flag (as typed) and help, from `qbatch run` and `qbatch embed`."""
    import click

    from qbatch.cli import embed, run

    helps: dict[str, tuple[str, str]] = {}
    for command in (run, embed):
        for param in command.params:
            if isinstance(param, click.Option) and param.name not in helps:
                flag = " / ".join(param.opts + param.secondary_opts)
                helps[param.name] = (flag, param.help or "")
    return helps


def _type_name(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if typing.get_origin(hint) is list:
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    if typing.get_origin(hint) is dict:  # lora: a [lora] table of NAME = "PATH"
        return "table of str"
    if args and len(args) == 1:
        return _type_name(args[0])
    return getattr(hint, "__name__", str(hint))


def _default(field: dataclasses.Field) -> str:
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        value = field.default
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _cell(text: str) -> str:
    """Table-safe text: pipes escaped, newlines joined."""
    return " ".join(text.split()).replace("|", "\\|")
