"""The CLI documents itself: every command has help with examples, and the README
names every flag of `qbatch run` and `qbatch embed`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qbatch.cli import cli as qbatch_cli

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


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


@pytest.mark.parametrize("command", ["run", "embed"])
def test_readme_names_every_run_flag(command):
    flags = [opt for param in qbatch_cli.commands[command].params for opt in param.opts if opt.startswith("--")]
    undocumented = [flag for flag in flags if flag not in README and flag not in ("--backend", "--help")]
    assert undocumented == []


def test_help_does_not_import_vllm_or_torch():
    import subprocess
    import sys

    code = ("import sys; from qbatch.cli import cli; "
            "sys.argv = ['qbatch', 'run', '--help']\n"
            "try: cli()\nexcept SystemExit: pass\n"
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, 'heavy import'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
