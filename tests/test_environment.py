"""The pinned environment: requirements.txt and environment.yml agree, and the pins are the ones installed."""

import os
from importlib.metadata import PackageNotFoundError, version
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


COMPAT = os.environ.get("ACCEL_COMPAT") == "1"  # set by `make test-compat` (.venv-compat, newer torch)


def _pinned(path):
    """{package: version} of the exact pins in a requirements file (markers dropped)."""
    pins = {}
    for line in _pins((ROOT / path).read_text().splitlines()):
        if "==" in line:
            name, ver = line.split(";")[0].split("==")
            pins[name.strip()] = ver.strip()
    return pins


def _expected():
    pins = _pinned("requirements.txt")
    if COMPAT:
        pins.update(_pinned("requirements-compat.txt"))
    return pins


@pytest.mark.parametrize("name", ["torch", "torchvision", "fastai", "accelerate", "onnxruntime"])
def test_core_pins_installed(name):
    assert version(name).split("+")[0] == _expected()[name]


def test_compat_pins_are_newer_torch_and_replace_only_torch_and_torchvision():
    compat, main = _pinned("requirements-compat.txt"), _pinned("requirements.txt")
    assert set(compat) == {"torch", "torchvision"}
    as_tuple = lambda v: tuple(int(p) for p in v.split("."))
    assert all(as_tuple(compat[k]) > as_tuple(main[k]) for k in compat)


@pytest.mark.skipif(not COMPAT, reason="only in `make test-compat`")
def test_compat_environment_has_no_torch_xla():
    with pytest.raises(PackageNotFoundError):
        version("torch_xla")


def test_every_requirement_is_pinned_exactly():
    for line in _pins((ROOT / "requirements.txt").read_text().splitlines()):
        if line != "-e .":
            assert "==" in line, f"{line!r} is not pinned"
