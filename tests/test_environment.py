"""The pinned environment: requirements.txt and environment.yml agree, and the pins are the ones installed."""

from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pins(lines):
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def test_environment_yml_matches_requirements():
    req = _pins((ROOT / "requirements.txt").read_text().splitlines())
    yml = (ROOT / "environment.yml").read_text().splitlines()
    assert "  - python=3.11" in yml
    start = yml.index("  - pip:")
    pip_lines = [ln.strip()[2:] for ln in yml[start + 1:] if ln.strip().startswith("- ")]
    assert pip_lines == req


@pytest.mark.parametrize("name,pin", [("torch", "2.9.0"), ("torchvision", "0.24.0"), ("fastai", "2.8.12")])
def test_core_pins_installed(name, pin):
    assert version(name).split("+")[0] == pin


def test_every_requirement_is_pinned_exactly():
    for line in _pins((ROOT / "requirements.txt").read_text().splitlines()):
        if line != "-e .":
            assert "==" in line, f"{line!r} is not pinned"
