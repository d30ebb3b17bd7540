"""The schedule of `make test` (tests/conftest.py's COST) names files that exist."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_file_in_the_schedule_exists():
    """COST orders `make test`'s files longest first: a renamed file would silently lose its place."""
    from tests.conftest import COST

    notebooks = TESTS.parent / "notebooks"
    missing = [n for n in COST if not (TESTS / f"{n}.py").exists() and not (notebooks / f"{n}.ipynb").exists()]
    assert not missing, f"tests/conftest.py COST names files that do not exist: {missing}"
