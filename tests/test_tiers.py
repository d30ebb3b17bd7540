"""The fast tier leaves out only what tests/conftest.py names as slow, and every name there is a test that exists."""

import ast
from pathlib import Path

from tests.conftest import SLOW

TESTS = Path(__file__).resolve().parent


def test_every_slow_test_named_exists():
    missing = []
    for module, names in SLOW.items():
        path = TESTS / f"{module}.py"
        defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)} \
            if path.exists() else set()
        missing += [f"{module}::{n}" for n in sorted(names - defined)]
    assert not missing, f"tests/conftest.py SLOW names tests that do not exist (renamed?): {missing}"


def test_every_file_in_the_schedule_exists():
    """COST orders `make test`'s files longest first: a renamed file would silently lose its place."""
    from tests.conftest import COST

    notebooks = TESTS.parent / "notebooks"
    missing = [n for n in COST if not (TESTS / f"{n}.py").exists() and not (notebooks / f"{n}.ipynb").exists()]
    assert not missing, f"tests/conftest.py COST names files that do not exist: {missing}"
