"""The docs' examples run as tests (Sybil): every ```python and ```bash block of README.md and docs/.

How a page's examples run (the root conftest.py collects them):
- in a scratch folder holding copies of sample_data/ and jobs/, so paths read as in a clone;
- on the null engine with the bundled model: QBATCH_MODEL=smollm2-135m, `qbatch.Session`'s default
  backend is "null", and `qbatch run` / `qbatch embed` get `--backend null` unless they name one;
- a page's Python blocks share one namespace; a bash block's commands run one by one, in order,
  and each must exit 0, or N where its line ends with a comment `# exits N...`;
- `<!-- skip: next "why" -->` before a block skips it (GPU-only, hub models, servers, installs):
  tests/docs/test_doc_commands.py still checks its `qbatch` lines against the CLI's flags.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"  # the bundled model: offline, and the null engine needs only its tokenizer
COPIED = ("sample_data", "jobs")
EXPECTED_EXIT = re.compile(r"#\s*exits\s+(\d+)")
SHELL_SYNTAX = re.compile(r"[|&;<>$`()]|^\w+=")  # lines that need bash rather than the in-process CLI
PIPED_FILE = re.compile(r"cat (\S+) \| (qbatch .*)")  # a file piped into qbatch: in-process, the file as stdin
NULL_CLI = Path(__file__).with_name("qbatch_null.py")
SEPARATORS = {"|", "||", "&&", ";"}


def commands(source: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comment-only and blank lines dropped."""
    joined, out = "", []
    for line in source.splitlines():
        joined += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        if joined.strip() and not joined.lstrip().startswith("#"):
            out.append(joined.strip())
        joined = ""
    return out


def expected_exit(command: str) -> int:
    found = EXPECTED_EXIT.search(command)
    return int(found.group(1)) if found else 0


def with_null_backend(args: list[str]) -> list[str]:
    """`qbatch run|embed ARGS` on the null engine, unless the command names a backend."""
    if args[:1] in (["run"], ["embed"]) and not any(a == "--backend" or a.startswith("--backend=") for a in args):
        return [args[0], "--backend", "null", *args[1:]]
    return args


def run_bash_block(example: Example) -> None:
    for command in commands(example.parsed):
        want = expected_exit(command)
        code, output = run_command(command)
        if code != want:
            raise AssertionError(f"`{command}` exited {code}, the docs say {want}:\n{output}")


def run_command(command: str, bin_dir: Path | None = None) -> tuple[int, str]:
    """(exit code, output) of a documented command. Plain `qbatch` commands run in this process (a
    new process spends seconds importing the tokenizer's libraries); anything else in bash, with
    `bin_dir`'s qbatch (qbatch_bin; default: the page's scratch folder's) first on the PATH."""
    words = shlex.split(command, comments=True)
    if words[:1] == ["qbatch"] and not SHELL_SYNTAX.search(command.split("#", 1)[0]):
        return _in_process(words[1:])
    piped = PIPED_FILE.fullmatch(command.split("#", 1)[0].strip())
    if piped:
        return _in_process(shlex.split(piped.group(2))[1:], stdin=Path(piped.group(1)).read_bytes())
    bin_dir = bin_dir or Path("bin").resolve()
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    return result.returncode, result.stdout + result.stderr


def _in_process(args: list[str], stdin: bytes | None = None) -> tuple[int, str]:
    from click.testing import CliRunner

    from qbatch.cli import cli

    result = CliRunner().invoke(cli, with_null_backend(args), input=stdin)
    output = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        output += "".join(traceback.format_exception(result.exception))
    return result.exit_code, output


def qbatch_invocations(command: str) -> list[list[str]]:
    """The argument lists of each `qbatch ...` in a shell command (pipes, &&, env prefixes allowed)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars="|&;")
    lexer.whitespace_split, lexer.commenters = True, "#"
    out, current = [], []
    for word in [*lexer, ";"]:
        if word in SEPARATORS:
            while current and re.fullmatch(r"\w+=.*", current[0]):  # VAR=value prefixes
                current.pop(0)
            for tool in ("timeout",):  # wrappers in front of qbatch
                if current[:1] == [tool]:
                    current = current[next(i for i, w in enumerate(current) if w == "qbatch"):]
            if current[:1] == ["qbatch"]:
                out.append(current[1:])
            current = []
        else:
            current.append(word)
    return out


def check(args: list[str]) -> None:
    """Parse `qbatch ARGS` as the CLI would, without running it (paths need not exist)."""
    import click

    from qbatch.cli import cli

    name, rest = args[0], args[1:]
    assert name in cli.commands or name.startswith("-"), f"no command {name!r}"
    command = cli if name.startswith("-") else cli.commands[name]
    original = click.Path.convert
    click.Path.convert = lambda self, value, param, ctx: value  # type: ignore[method-assign]
    try:
        command.make_context(f"qbatch {name}", list(args if command is cli else rest))
    except click.exceptions.Exit:
        pass  # --help, --version
    finally:
        click.Path.convert = original  # type: ignore[method-assign]


def check_names(args: list[str]) -> None:
    """The command and every flag exist (running text names them without their values)."""
    from qbatch.cli import cli

    command = cli.commands.get(args[0])
    assert command is not None, f"no command {args[0]!r}"
    known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {"--help", "-h"}
    unknown = [word.split("=")[0] for word in args[1:] if word.startswith("-") and word.split("=")[0] not in known
               and word != "-"]
    assert unknown == [], f"qbatch {args[0]} has no {', '.join(unknown)}"


def qbatch_bin(folder: Path) -> Path:
    """A folder holding a `qbatch` that runs this checkout's CLI on the null engine (for PATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "qbatch"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{NULL_CLI}" "$@"\n')
    wrapper.chmod(0o755)
    return folder


def setup(namespace: dict[str, Any]) -> None:
    """A page's scratch folder, environment and null-engine default (undone by teardown)."""
    from qbatch.session import session

    scratch = Path(tempfile.mkdtemp(prefix="qbatch-docs-"))
    for name in COPIED:
        shutil.copytree(ROOT / name, scratch / name)
    qbatch_bin(scratch / "bin")
    original_init = session.Session.__init__

    def null_by_default(self: Any, model: str | None = None, **settings: Any) -> None:
        settings.setdefault("backend", "null")
        original_init(self, model, **settings)

    namespace.update(__name__="__main__", _docs_state={
        "cwd": os.getcwd(), "scratch": scratch, "init": original_init,
        "env": {k: os.environ.get(k) for k in ("QBATCH_MODEL", "PYTHONPATH")}})
    session.Session.__init__ = null_by_default  # type: ignore[method-assign]
    os.environ["QBATCH_MODEL"] = MODEL
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.chdir(scratch)


def teardown(namespace: dict[str, Any]) -> None:
    from qbatch.session import session

    state = namespace["_docs_state"]  # a page's Sessions own their engines (null ones: nothing to close)
    session.Session.__init__ = state["init"]  # type: ignore[method-assign]
    for key, value in state["env"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.chdir(state["cwd"])
    shutil.rmtree(state["scratch"], ignore_errors=True)


def _sybil(path: str, patterns: list[str], excludes: list[str]) -> Sybil:
    return Sybil(parsers=[PythonCodeBlockParser(), CodeBlockParser("bash", run_bash_block), SkipParser()],
                 path=str(ROOT / path), patterns=patterns, excludes=excludes, setup=setup, teardown=teardown)


# The benchmark record's commands ran on GPUs: they are the record, not examples (their flags are
# still checked by test_doc_commands.py).
DOCS = _sybil("docs", ["*.md"], ["benchmarks.md"])
README = _sybil(".", ["README.md"], ["*/README.md"])
