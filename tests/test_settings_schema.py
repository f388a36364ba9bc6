"""A setting is declared once (spec.py's `setting(...)`): its flag, help, shown default, choices, range and
panel are generated from that declaration (cli.flag_of, Setting.check), as a new setting's would be."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal

import click
import pytest
from click.testing import CliRunner

from qbatch.errors import SpecError
from qbatch.cli import flag_of
from qbatch.spec import declared, setting


@dataclass(frozen=True)
class NewSection:
    """Settings a new feature would add: each declared here alone."""

    colour: Literal["red", "blue"] = setting("red", "The colour.", panel="Output")
    window: int | None = setting(None, "Rows a window.", panel="Chunks and order", low=1, shown="all of them")
    share: float | None = setting(None, "A share.", panel="Output", low=0, high=1, metavar="SHARE")
    strict: bool = setting(False, "Be strict.", panel="Output")
    eager: bool | None = setting(None, "Be eager.", panel="Output", shown="on for CPU")
    tags: list[str] | None = setting(None, "Tags (comma list).", panel="Input")
    stops: list[str] | None = setting(None, "A stop (repeatable).", panel="Input", repeat=True)


def _command() -> click.Command:
    """A command taking NewSection's settings, through the generator `qbatch run` uses."""
    def show(**given: object) -> None:
        click.echo(repr({name: value for name, value in sorted(given.items()) if value not in (None, ())}))

    hints = typing.get_type_hints(NewSection)
    for field in reversed(dataclasses.fields(NewSection)):
        show = flag_of(field, hints[field.name])(show)
    return click.command()(show)


def test_a_new_settings_flags_come_from_its_declaration():
    help_text = " ".join(CliRunner().invoke(_command(), ["--help"], terminal_width=200).output.split())
    assert "--colour [red|blue] The colour. [default: red]" in help_text  # the field's own default
    assert "--window INTEGER Rows a window. [default: all of them]" in help_text  # or what decides it
    assert "--share SHARE A share." in help_text and "--strict Be strict." in help_text
    assert "--eager / --no-eager Be eager. [default: on for CPU]" in help_text
    result = CliRunner().invoke(_command(), ["--colour", "blue", "--strict", "--no-eager", "--tags", "a, b",
                                             "--stops", "x", "--stops", "y", "--window", "3"])
    assert result.output.strip() == ("{'colour': 'blue', 'eager': False, 'stops': ('x', 'y'), 'strict': True, "
                                     "'tags': ['a', 'b'], 'window': 3}")
    assert CliRunner().invoke(_command(), ["--colour", "green"]).exit_code == 2  # a choice is click's too


@pytest.mark.parametrize(("name", "value", "message"), [
    ("window", 0, "window must be an integer >= 1, got 0"),
    ("share", 1.5, "share must be in [0, 1], got 1.5"),
])
def test_a_new_settings_range_is_checked_from_its_declaration(name, value, message):
    field = next(f for f in dataclasses.fields(NewSection) if f.name == name)
    declared(field).check(name, 1)  # in range: no error
    with pytest.raises(SpecError) as info:
        declared(field).check(name, value)
    assert info.value.message == message


def test_every_setting_but_the_commands_own_has_a_flag_and_every_flag_a_setting():
    """The flags of run and embed are the settings' (inputs: the INPUT arguments; task: the command's)."""
    from qbatch.cli import CLI_ONLY, embed, run
    from qbatch.spec import SECTIONS

    flags = {param.name for command in (run, embed) for param in command.params if isinstance(param, click.Option)}
    settings = {field.name for cls in SECTIONS.values() for field in dataclasses.fields(cls)}
    assert settings - flags == {"inputs", "task"}
    assert flags - settings == CLI_ONLY - {"inputs"} | {"verbose"}
