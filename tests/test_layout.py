"""The code's shape, checked: what the import contracts (pyproject.toml, `lint-imports`) do not cover."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "qbatch"
MAX_TOP_LEVEL_MODULES = 11  # 11th: tokens.py, the one encoding rule of the driver and the engines


def _imports(path: Path) -> list[tuple[str, str, int]]:
    """(module, name, line) for every `from qbatch... import name` in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.module, alias.name, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qbatch")
            for alias in node.names]


def test_no_private_name_crosses_a_module():
    """A name with a leading underscore is its module's own: another module needing it means the
    name is public (rename it) or the code is in the wrong place."""
    crossing = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} from {module}"
                for path in PACKAGE.rglob("*.py") for module, name, line in _imports(path)
                if name.startswith("_") and not name.startswith("__")]
    assert crossing == []


def test_the_top_level_holds_few_modules():
    """The top of the package holds the entry points and the few shared foundations; the rest lives
    in the packages by role (inputs, jobs, engines, output, models, bench, session)."""
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules


def test_the_files_the_suite_starts_first_are_real_engine_files_that_exist():
    """`make test` starts these files' real-engine tests first (tests/conftest.py's LONGEST_FIRST): a file
    renamed or moved would silently lose its place."""
    from tests.conftest import LONGEST_FIRST, ROOT

    for path in LONGEST_FIRST:
        assert "mark.slow" in (ROOT / path).read_text(), path
