"""The pinned environment: requirements.txt holds the pins and environment.yml only wraps it for conda, and the pins
are the ones installed."""

import os
import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pins(lines):
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def _conda_env():
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def test_environment_yml_wraps_requirements():
    """conda's environment is Python and pip, then pip installs requirements.txt (the checkout's package with it): no
    second copy of a pin to fall behind. Conda runs pip from the file's folder, so the path is this checkout's."""
    python, pip, pip_section = _conda_env()["dependencies"]
    assert re.fullmatch(r"python=\d+\.\d+", python) and pip == "pip"
    assert pip_section == {"pip": ["-r requirements.txt"]}
    assert "-e ." in _pins((ROOT / "requirements.txt").read_text().splitlines())


def test_one_python_version():
    """environment.yml's Python is the oldest that pyproject.toml allows, the one the Makefile's venv prefers."""
    python = _conda_env()["dependencies"][0].removeprefix("python=")
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == f">={python}"
    assert re.search(r"^PYTHON \?= \$\(shell command -v python(\d+\.\d+) ", (ROOT / "Makefile").read_text(),
                     re.M).group(1) == python


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
