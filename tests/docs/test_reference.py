"""The site builds (strict, with no fetch from the network), and its reference pages hold every
command, flag, job-file key, exit code, output column and error kind the code has."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT

from qbatch import errors
from qbatch.cli import cli

DOCS = ROOT / "docs"
REMOTE_ASSETS = re.compile(r"fonts\.googleapis|fonts\.gstatic|cdn\.jsdelivr|unpkg\.com")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """`mkdocs build --strict` of this checkout: a warning (a broken link or anchor) fails it."""
    folder = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(folder)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    return folder


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", page.read_text()))


def test_the_site_loads_nothing_from_the_network(site):
    remote = [f"{page.relative_to(site)}: {match}" for page in site.rglob("*.html")
              for match in REMOTE_ASSETS.findall(page.read_text())]
    assert remote == []


def test_the_cli_reference_has_every_command_and_flag(site):
    page = _text(site / "reference" / "cli" / "index.html")
    missing = [f"qbatch {name}" for name in cli.commands if f"qbatch {name}" not in page]
    missing += [f"qbatch {name} {opt}" for name, command in cli.commands.items() for param in command.params
                if not getattr(param, "hidden", False) for opt in (*param.opts, *param.secondary_opts)
                if opt.startswith("-") and opt not in page]
    assert missing == []


def test_the_job_file_page_has_every_key(site):
    from qbatch.spec import SECTIONS

    page = _text(site / "reference" / "job-files" / "index.html")
    keys = [field for cls in SECTIONS.values() for field in cls.__dataclass_fields__]
    assert [key for key in keys if not re.search(rf"\b{key}\b", page)] == []


def test_the_exit_code_page_has_every_code():
    page = (DOCS / "reference" / "exit-codes.md").read_text()
    codes = {value for name, value in vars(errors).items() if name.startswith("EXIT_")}
    rows = {int(code) for row in re.findall(r"^\| ([\d, ]+) \|", page, re.M) for code in row.split(",")}
    assert codes - rows == set()


def test_the_output_page_has_every_column_and_error_kind():
    from qbatch.output.folder import DUPLICATE_ID
    from qbatch.output.samples import COLUMN_TYPES
    from qbatch.output.tables import ERROR_SCHEMA, RESULT_HEAD, RESULT_TAIL

    page = (DOCS / "reference" / "output.md").read_text()
    columns = [*ERROR_SCHEMA.names, *(name for name, _ in RESULT_HEAD + RESULT_TAIL), *COLUMN_TYPES,
               "source", "prompt", "embedding"]
    hidden = {"source_index"}  # dropped at assembly
    assert [c for c in columns if c not in hidden and f"| `{c}` |" not in page] == []
    source = "".join(path.read_text() for path in (ROOT / "qbatch").rglob("*.py"))
    kinds = {*re.findall(r'RowError\(\s*"([a-z_]+)"', source), *re.findall(r'Failure\([^()]*?"([a-z_]+)"', source, re.S),
             DUPLICATE_ID}
    assert sorted(kind for kind in kinds if f"`{kind}`" not in page) == []
